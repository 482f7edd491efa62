// Completion forecasts: the last swap of each direction, scaled by blocks.
#include "completion_forecast.h"

#include <algorithm>

namespace kvtd::engine {

namespace {
// Stamps from another clock (a test's) or a rank that stalled say nothing about the next swap.
constexpr std::int64_t kMaxForecastNs = 1'000'000'000;
}  // namespace

int CompletionForecast::direction(proto::TaskKind kind) {
  if (kind == proto::TaskKind::kSwapToHost) return 0;
  if (kind == proto::TaskKind::kSwapToDevice) return 1;
  return -1;
}

void CompletionForecast::learn(proto::TaskKind kind, std::uint64_t blocks, std::int64_t submit_ns,
                               std::int64_t start_ns, std::int64_t end_ns) {
  const int d = direction(kind);
  if (d < 0 || blocks == 0 || start_ns <= 0 || end_ns < start_ns) return;
  const std::int64_t lead = start_ns - submit_ns, exec = end_ns - start_ns;
  if (lead < 0 || lead > kMaxForecastNs || exec > kMaxForecastNs) return;
  last_[d] = Last{blocks, lead, exec};
}

std::optional<std::int64_t> CompletionForecast::end_of(proto::TaskKind kind, std::uint64_t blocks,
                                                       std::int64_t submit_ns) const {
  const int d = direction(kind);
  if (d < 0 || blocks == 0 || last_[d].blocks == 0) return std::nullopt;
  const Last& l = last_[d];
  const double exec = static_cast<double>(l.exec_ns) * static_cast<double>(blocks) / static_cast<double>(l.blocks);
  if (exec > static_cast<double>(kMaxForecastNs)) return std::nullopt;
  return submit_ns + l.lead_ns + static_cast<std::int64_t>(exec);
}

CompletionWait plan_completion_wait(std::int64_t submit_ns, std::int64_t end_ns) {
  const std::int64_t half = std::clamp<std::int64_t>((end_ns - submit_ns) / 16, 20'000, 200'000);
  return CompletionWait{end_ns - half, end_ns + half};
}

WaitLanding landing_of(const CompletionWait& w, std::int64_t taken_ns) {
  if (taken_ns < w.sleep_until_ns) return WaitLanding::kBeforeWindow;
  return taken_ns <= w.poll_until_ns ? WaitLanding::kInWindow : WaitLanding::kAfterWindow;
}

}  // namespace kvtd::engine
