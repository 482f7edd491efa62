// The swaps in flight and their completion forecast.
#include "pending_swaps.h"

namespace kvtd::engine {

void PendingSwaps::submitted(std::uint64_t task_id, proto::TaskKind kind, std::uint64_t blocks,
                             std::int64_t submit_ns) {
  const int way = CompletionForecast::direction(kind);
  if (way < 0) return;
  shapes_[task_id] = Shape{kind, blocks, submit_ns};
  ++each_way_[way];
}

void PendingSwaps::finished(std::uint64_t task_id, const TaskResult* result) {
  const auto it = shapes_.find(task_id);
  if (it == shapes_.end()) return;
  const Shape& s = it->second;
  if (result != nullptr && result->ok())
    forecast_.learn(s.kind, s.blocks, s.submit_ns, result->first_start_ns, result->last_end_ns);
  --each_way_[CompletionForecast::direction(s.kind)];
  shapes_.erase(it);
}

std::vector<std::uint64_t> PendingSwaps::ids() const {
  std::vector<std::uint64_t> out;
  out.reserve(shapes_.size());
  for (const auto& entry : shapes_) out.push_back(entry.first);
  return out;
}

std::optional<CompletionWait> PendingSwaps::wait_for(std::uint64_t task_id) const {
  const auto it = shapes_.find(task_id);
  if (it == shapes_.end()) return std::nullopt;
  const Shape& s = it->second;
  if (each_way_[CompletionForecast::direction(s.kind)] != 1) return std::nullopt;
  const auto end = forecast_.end_of(s.kind, s.blocks, s.submit_ns);
  if (!end) return std::nullopt;
  return plan_completion_wait(s.submit_ns, *end);
}

void PendingSwaps::count_wait(const CompletionWait& around, std::int64_t taken_ns) {
  ++waits_.waits;
  switch (landing_of(around, taken_ns)) {
    case WaitLanding::kBeforeWindow: ++waits_.before_window; break;
    case WaitLanding::kInWindow: ++waits_.in_window; break;
    case WaitLanding::kAfterWindow: ++waits_.after_window; break;
  }
}

}  // namespace kvtd::engine
