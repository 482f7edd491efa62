// completion_merger.h (client/engine internal) - folds each rank's report of a task into the
// one result the engine hands out: done when every expected rank reported; the status is the
// lowest-numbered failing rank's whatever the order reports arrived in; blocks_done and
// blocks_skipped are the MIN over ranks; a failure other than a cancel moved nothing usable
// (blocks_done 0); a late or duplicate report changes nothing.
//
// One truth per task: a CANCEL's answer (blocks_done 1: its target stopped, 0: it ran on as it
// was) is the target's merged outcome, not the ranks' separate guesses. Ranks decide apart (one
// may stop the target while another is already past its last step, and the target then fails
// cancelled although a MIN over the CANCEL's reports said 0), so a CANCEL whose target is still
// pending is held until the target's result is in, then answered 1 exactly when the target ended
// cancelled.
//
// Thread-safety: none (a value); the session keeps it under its mutex. Copyable and movable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>

#include "kvtd/engine/engine_session.h"

namespace kvtd::engine {

class CompletionMerger {
 public:
  // At most `max_uncollected` results are kept for wait()/poll(); older ones are dropped.
  explicit CompletionMerger(std::size_t max_uncollected = 1 << 16) : max_uncollected_(max_uncollected) {}

  // Task `task_id` (ring sequence `seq`, submitted at `submit_ns`) waits for a report from every
  // rank in the `expected` bit mask (ranks < 32).
  // `cancels`: for a CANCEL, the task it names (0 otherwise).
  void expect(std::uint64_t task_id, std::uint64_t seq, std::uint32_t expected, std::int64_t submit_ns,
              std::uint64_t cancels = 0);
  // Rank `rank`'s report of `task_id`; true when it completed the task (its result is ready).
  bool report(std::uint64_t task_id, std::uint32_t rank, proto::TaskStatus status, std::uint64_t blocks,
              std::string message, std::uint64_t skipped, std::int64_t now_ns);
  // A rank's report of `task_id` says when it began executing and when it wrote the report
  // (CLOCK_MONOTONIC); kept as the result's first_start_ns (MIN) and last_end_ns (MAX). Before
  // report() of the same record.
  void note_times(std::uint64_t task_id, std::int64_t start_ns, std::int64_t end_ns);
  // Fails every task still waiting for `rank`'s report with `status`; returns how many.
  std::size_t fail_rank(std::uint32_t rank, proto::TaskStatus status, const std::string& why, std::int64_t now_ns);

  // The completed result, handed out once.
  std::optional<TaskResult> take(std::uint64_t task_id);
  // The completed result without taking it, or null.
  const TaskResult* peek(std::uint64_t task_id) const;
  // Whether the task waits for reports; its sequence number and the ranks that reported.
  bool pending(std::uint64_t task_id) const { return pending_.count(task_id) != 0 || held_.count(task_id) != 0; }
  std::optional<std::uint64_t> seq_of(std::uint64_t task_id) const;
  std::uint32_t reported(std::uint64_t task_id) const;
  std::size_t pending_count() const { return pending_.size() + held_.size(); }

 private:
  struct Pending {
    std::uint64_t seq = 0;       // ring sequence number: locates the layer progress slot
    std::uint32_t expected = 0;  // rank bit mask
    std::uint32_t reported = 0;
    std::uint64_t cancels = 0;   // a CANCEL watching a pending task: its id
    TaskResult result;
  };
  void record(Pending& p, std::uint32_t rank, proto::TaskStatus status, std::uint64_t blocks, std::string message,
              std::uint64_t skipped);
  bool finish_if_complete(std::uint64_t id, Pending& p, std::int64_t now_ns);
  // Hands out a finished result (a CANCEL's answer set from its target's outcome first).
  void publish(std::uint64_t id, TaskResult result);
  // Task `id` ended with `result`: answers the CANCELs that watch it.
  void settle_cancels_of(std::uint64_t id, const TaskResult& result);

  std::size_t max_uncollected_;
  std::unordered_map<std::uint64_t, Pending> pending_;
  std::map<std::uint64_t, TaskResult> done_;  // ordered by id: the oldest is dropped first
  std::unordered_multimap<std::uint64_t, std::uint64_t> watchers_;  // pending target -> its CANCELs
  std::unordered_map<std::uint64_t, TaskResult> held_;          // merged CANCELs waiting for their target
  std::unordered_map<std::uint64_t, bool> target_cancelled_;     // CANCEL -> its target ended cancelled
};

}  // namespace kvtd::engine
