// completion_merger.h (client/engine internal) - folds each rank's report of a task into the
// one result the engine hands out: done when every expected rank reported; the status is the
// lowest-numbered failing rank's whatever the order reports arrived in; blocks_done and
// blocks_skipped are the MIN over ranks; a failure other than a cancel moved nothing usable
// (blocks_done 0); a late or duplicate report changes nothing.
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
  void expect(std::uint64_t task_id, std::uint64_t seq, std::uint32_t expected, std::int64_t submit_ns);
  // Rank `rank`'s report of `task_id`; true when it completed the task (its result is ready).
  bool report(std::uint64_t task_id, std::uint32_t rank, proto::TaskStatus status, std::uint64_t blocks,
              std::string message, std::uint64_t skipped, std::int64_t now_ns);
  // Fails every task still waiting for `rank`'s report with `status`; returns how many.
  std::size_t fail_rank(std::uint32_t rank, proto::TaskStatus status, const std::string& why, std::int64_t now_ns);

  // The completed result, handed out once.
  std::optional<TaskResult> take(std::uint64_t task_id);
  // The completed result without taking it, or null.
  const TaskResult* peek(std::uint64_t task_id) const;
  // Whether the task waits for reports; its sequence number and the ranks that reported.
  bool pending(std::uint64_t task_id) const { return pending_.count(task_id) != 0; }
  std::optional<std::uint64_t> seq_of(std::uint64_t task_id) const;
  std::uint32_t reported(std::uint64_t task_id) const;
  std::size_t pending_count() const { return pending_.size(); }

 private:
  struct Pending {
    std::uint64_t seq = 0;       // ring sequence number: locates the layer progress slot
    std::uint32_t expected = 0;  // rank bit mask
    std::uint32_t reported = 0;
    TaskResult result;
  };
  void record(Pending& p, std::uint32_t rank, proto::TaskStatus status, std::uint64_t blocks, std::string message,
              std::uint64_t skipped);
  bool finish_if_complete(std::uint64_t id, Pending& p, std::int64_t now_ns);

  std::size_t max_uncollected_;
  std::unordered_map<std::uint64_t, Pending> pending_;
  std::map<std::uint64_t, TaskResult> done_;  // ordered by id: the oldest is dropped first
};

}  // namespace kvtd::engine
