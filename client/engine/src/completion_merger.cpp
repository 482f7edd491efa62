// Completion merging: each rank's report folded into one result per task (the lowest failing
// rank's status, MIN blocks, a CANCEL's one answer).
#include "completion_merger.h"

#include <algorithm>
#include <string>
#include <vector>

namespace kvtd::engine {

using proto::TaskStatus;

void CompletionMerger::expect(std::uint64_t task_id, std::uint64_t seq, std::uint32_t expected, std::int64_t submit_ns,
                              std::uint64_t cancels) {
  Pending p;
  p.seq = seq;
  p.expected = expected;
  p.result.task_id = task_id;
  p.result.submit_ns = submit_ns;
  // Only a target still waiting for reports is watched: one that ended before was not stopped.
  if (cancels != 0 && pending_.count(cancels) != 0) {
    p.cancels = cancels;
    watchers_.emplace(cancels, task_id);
  }
  pending_.emplace(task_id, std::move(p));
}

void CompletionMerger::publish(std::uint64_t id, TaskResult result) {
  if (auto t = target_cancelled_.find(id); t != target_cancelled_.end()) {
    if (result.ok()) result.blocks_done = t->second ? 1 : 0;
    target_cancelled_.erase(t);
  }
  done_.emplace(id, std::move(result));
  while (done_.size() > max_uncollected_) done_.erase(done_.begin());  // nobody collects them
}

void CompletionMerger::settle_cancels_of(std::uint64_t id, const TaskResult& result) {
  const auto [first, last] = watchers_.equal_range(id);
  std::vector<std::uint64_t> cancels;
  for (auto it = first; it != last; ++it) cancels.push_back(it->second);
  watchers_.erase(id);
  const bool cancelled = result.status == TaskStatus::kCancelled;
  for (auto c : cancels) {
    target_cancelled_[c] = cancelled;
    if (auto h = held_.find(c); h != held_.end()) {
      TaskResult r = std::move(h->second);
      held_.erase(h);
      publish(c, std::move(r));
    }
  }
}

void CompletionMerger::record(Pending& p, std::uint32_t rank, TaskStatus status, std::uint64_t blocks,
                              std::string message, std::uint64_t skipped) {
  const std::uint32_t bit = 1u << rank;
  if ((p.expected & bit) == 0 || (p.reported & bit) != 0) return;  // late or duplicate report
  const bool first = p.reported == 0;
  p.reported |= bit;
  if (status != TaskStatus::kOk) {
    p.result.failures.push_back(RankFailure{rank, status, std::move(message)});
    if (status != TaskStatus::kCancelled) blocks = 0;
  }
  if (first || blocks < p.result.blocks_done) p.result.blocks_done = blocks;  // MIN over ranks
  if (first || skipped < p.result.blocks_skipped) p.result.blocks_skipped = skipped;
}

bool CompletionMerger::finish_if_complete(std::uint64_t id, Pending& p, std::int64_t now_ns) {
  if (p.reported != p.expected) return false;
  p.result.complete_ns = now_ns;
  // The merged status is the failure of the lowest-numbered failing rank, whatever the order
  // in which reports arrived.
  std::sort(p.result.failures.begin(), p.result.failures.end(),
            [](const RankFailure& a, const RankFailure& b) { return a.rank < b.rank; });
  p.result.status = p.result.failures.empty() ? TaskStatus::kOk : p.result.failures.front().status;
  // A cancelled task keeps how far it got (MIN over ranks); any other failure moved nothing usable.
  if (!p.result.failures.empty() && p.result.status != TaskStatus::kCancelled) p.result.blocks_done = 0;
  TaskResult result = std::move(p.result);
  const std::uint64_t target = p.cancels;
  pending_.erase(id);
  settle_cancels_of(id, result);
  if (target != 0 && target_cancelled_.count(id) == 0) {
    held_.emplace(id, std::move(result));  // its target's outcome answers it
    return false;
  }
  publish(id, std::move(result));
  return true;
}

bool CompletionMerger::report(std::uint64_t task_id, std::uint32_t rank, TaskStatus status, std::uint64_t blocks,
                              std::string message, std::uint64_t skipped, std::int64_t now_ns) {
  auto it = pending_.find(task_id);
  if (it == pending_.end() || rank >= 32) return false;
  record(it->second, rank, status, blocks, std::move(message), skipped);
  return finish_if_complete(task_id, it->second, now_ns);
}

void CompletionMerger::note_times(std::uint64_t task_id, std::int64_t start_ns, std::int64_t end_ns) {
  auto it = pending_.find(task_id);
  if (it == pending_.end()) return;
  TaskResult& r = it->second.result;
  if (start_ns > 0 && (r.first_start_ns == 0 || start_ns < r.first_start_ns)) r.first_start_ns = start_ns;
  if (end_ns > r.last_end_ns) r.last_end_ns = end_ns;
}

std::size_t CompletionMerger::fail_rank(std::uint32_t rank, TaskStatus status, const std::string& why,
                                        std::int64_t now_ns) {
  if (rank >= 32) return 0;
  std::vector<std::uint64_t> ids;
  const std::uint32_t bit = 1u << rank;
  for (auto& [id, p] : pending_)
    if ((p.expected & bit) && !(p.reported & bit)) ids.push_back(id);
  for (auto id : ids) {
    auto& p = pending_[id];
    record(p, rank, status, 0, why, 0);
    finish_if_complete(id, p, now_ns);
  }
  return ids.size();
}

std::optional<TaskResult> CompletionMerger::take(std::uint64_t task_id) {
  auto it = done_.find(task_id);
  if (it == done_.end()) return std::nullopt;
  TaskResult r = std::move(it->second);
  done_.erase(it);
  return r;
}

const TaskResult* CompletionMerger::peek(std::uint64_t task_id) const {
  auto it = done_.find(task_id);
  return it == done_.end() ? nullptr : &it->second;
}

std::optional<std::uint64_t> CompletionMerger::seq_of(std::uint64_t task_id) const {
  auto it = pending_.find(task_id);
  if (it == pending_.end()) return std::nullopt;
  return it->second.seq;
}

std::uint32_t CompletionMerger::reported(std::uint64_t task_id) const {
  auto it = pending_.find(task_id);
  return it == pending_.end() ? 0 : it->second.reported;
}

}  // namespace kvtd::engine
