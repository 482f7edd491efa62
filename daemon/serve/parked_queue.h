// parked_queue.h (daemon-internal) - the tasks the dispatcher read but could not admit yet, in
// ring order, so that it goes on reading the ring (a CANCEL of a parked task takes effect at once,
// and work on other blocks runs) instead of sleeping until a conflict clears.
//
// A task must wait here when
//  - it conflicts with a task parked before it, on any lane (the block rule of block_counts.h, or
//    it names a parked task as its after-task): conflicting work keeps ring order;
//  - it is a storage task and one is parked before it: the agreement thread must meet storage
//    tasks in ring order on every rank, or two ranks could each wait on the other's task;
//  - or the block tracker does not admit it (it conflicts with work in flight).
// Work that does not conflict with a parked task overtakes it.
//
// Ownership: owns the parked tasks. Thread-safety: none; the dispatcher thread alone uses it.
// Not copyable.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <unordered_set>
#include <vector>

#include "block_counts.h"
#include "lane.h"
#include "work.h"

namespace kvtd::daemon {

class ParkedQueue {
 public:
  ParkedQueue(std::int64_t host_blocks, std::int64_t device_blocks);
  ParkedQueue(const ParkedQueue&) = delete;
  ParkedQueue& operator=(const ParkedQueue&) = delete;

  bool empty() const { return entries_.empty(); }
  std::size_t size() const { return entries_.size(); }

  // Whether `w` must wait behind a parked task (the first two rules above).
  bool must_wait(const Work& w) const;
  void park(Work&& w, Lane lane);

  // Offers each parked task, in ring order, that no task still parked ahead of it holds back to
  // `try_admit` (the block tracker); each admitted one is removed and handed to `go`. Returns how
  // many went.
  using TryAdmit = std::function<bool(const Work&, Lane lane)>;
  using Go = std::function<void(Work&&, Lane lane)>;
  std::size_t release_ready(const TryAdmit& try_admit, const Go& go);

  // Cancels parked task `task_id` and returns its header, for the caller to complete it as
  // cancelled; nullopt when it is not parked. A swap leaves the queue. A storage task keeps its
  // place with no blocks and no after-task (it conflicts with nothing now), marked answered: the
  // agreement thread must still meet it in ring order, to leave its agreement.
  std::optional<proto::TaskRecordHeader> cancel(std::uint64_t task_id);
  // Removes every parked task (a revoked epoch).
  std::vector<Work> take_all();

 private:
  struct Entry {
    Work work;
    Lane lane = Lane::kToHost;
  };
  void forget(const Entry& e);

  std::list<Entry> entries_;  // ring order; a list, so the tracked views into each Work stay valid
  BlockCounts parked_;        // the blocks of every parked task
  BlockCounts ahead_;         // scratch of release_ready(): the tasks it kept so far
  std::unordered_set<std::uint64_t> ids_;
  std::size_t storage_parked_ = 0;
};

}  // namespace kvtd::daemon
