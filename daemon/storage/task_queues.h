// task_queues.h (daemon/storage private) - the storage executor's queues and task sets. Phase 1
// (the agreement) takes tasks in ring order; phase 2 (moving objects) takes loads before writes,
// and writes take at most `write_workers` workers so a load always finds one. They know which
// tasks are live, cancelled, or past their last cancel check (committed), and hold the backups'
// backpressure: the bytes of backups agreed and not yet written.
//
// Thread-safety: every method may be called from any thread; the waits (next_to_agree,
// next_to_move) sleep on a futex word per queue, so a new task wakes only the thread that takes
// it. The lock is never held across a wait or I/O. Not copyable.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/storage_executor.h"

namespace kvtd::daemon {

// A task through phase 1: the keys it stores or loads, their blocks, the agreed count.
struct Prepared {
  StorageWork work;
  std::int64_t start = 0;
  std::vector<std::size_t> which;   // indices into work.section.keys that take part
  std::uint32_t parts = 1;          // objects per key (StorageTargets::slicing)
  std::vector<std::string> stored;  // their stored names: `parts` per key, key by key
  std::vector<std::int32_t> ids;    // their blocks
  std::uint32_t agreed = 0;         // keys (every part stored) agreed across ranks
  // A group session's task: an object per (key, group) it moves, `stored` holding their names
  // (parts 1, `ids` unused). key: index into `which`; id: the group's own block id.
  struct Unit {
    std::uint32_t key = 0, group = 0;
    std::int32_t id = -1;
  };
  std::vector<Unit> units;

  std::size_t keys() const { return stored.size() / parts; }
  std::uint64_t backup_bytes = 0;   // a backup's bytes still to write, counted in the backpressure
  std::int64_t queued_ns = 0;       // when phase 1 handed it to the workers
};

// Whether a STORAGE_WRITE is a backup (write-through, selective, write-back): work the engine does
// not wait for, skipped when the store falls behind.
inline bool is_backup(const StorageWork& w) {
  return (w.header.flags & (proto::kTaskFlagPolicyBackup | proto::kTaskFlagEvictBackup)) != 0;
}

class TaskQueues {
 public:
  struct Limits {
    std::uint32_t write_workers = 1;        // workers that may write at once
    std::uint64_t backup_queue_bytes = 0;   // --storage-backup-queue-mib
    std::int64_t backup_max_age_ns = 0;     // --storage-backup-max-age-ms
  };
  explicit TaskQueues(Limits limits) : limits_(limits) {}
  TaskQueues(const TaskQueues&) = delete;
  TaskQueues& operator=(const TaskQueues&) = delete;

  // Queues `w` for phase 1 unless it is a backup (`backup_bytes` given) the store cannot take
  // now: the agreement has been held past the age bound, or the queue bound is passed. Returns
  // that reason, `w` left untouched, or "" once `w` is queued.
  std::string admit(StorageWork& w, std::optional<std::uint64_t> backup_bytes, std::int64_t now) EXCLUDES(mu_);
  // Queues `w`, answered already, for phase 1 (it only leaves its agreement, in ring order).
  void push_answered(StorageWork&& w) EXCLUDES(mu_);
  // The next task for phase 1, waiting for one; nullopt once closing.
  std::optional<StorageWork> next_to_agree() EXCLUDES(mu_);
  void agreement_finished() EXCLUDES(mu_);  // phase 1 is idle again
  // The queue bound's reason to skip a backup of `bytes`, or "".
  std::string over_backup_bound(std::uint64_t bytes) EXCLUDES(mu_);
  // Hands `p` to phase 2 (a write at low priority; its backup_bytes join the backpressure).
  void to_objects(Prepared&& p) EXCLUDES(mu_);
  // Phase 1 has exited: workers stop once phase 2's queues are empty.
  void agreement_ended() EXCLUDES(mu_);

  struct Job {
    Prepared p;
    bool write = false;
  };
  // The next task for phase 2, waiting for one; nullopt once closed and empty.
  std::optional<Job> next_to_move() EXCLUDES(mu_);
  void moved(const Job& job) EXCLUDES(mu_);  // its worker is free again

  void forget(std::uint64_t task_id) EXCLUDES(mu_);  // done or dropped: no longer live
  // Marks a live task cancelled unless it is past its last check. True: it will stop.
  bool cancel(std::uint64_t task_id) EXCLUDES(mu_);
  bool is_cancelled(std::uint64_t task_id) EXCLUDES(mu_);
  // Checks for a CANCEL before a step; before the last one, also marks the task committed, so
  // a CANCEL that arrives later answers that it will not stop it. True: go on.
  bool may_continue(std::uint64_t task_id, bool last_step) EXCLUDES(mu_);
  // Takes every task not yet running out of the queues (no longer live).
  std::vector<StorageWork> drop_queued() EXCLUDES(mu_);
  void close() EXCLUDES(mu_);  // phase 1 stops taking tasks
  void wake_workers() { work_wake_.bump(); }

 private:
  // A futex word per queue (spin, then futex): a condition variable's wake-up alone cost tens of
  // microseconds per task, more than a whole swap round trip.
  struct Wake {
    std::atomic<std::uint32_t> word{0};
    std::atomic<std::uint32_t> waiters{0};
    void bump();
  };
  // Waits on `wake` until take() (called under mu_) hands something over or says to stop.
  template <typename Take>
  bool wait_for(Wake& wake, Take&& take);
  std::string over_backup_bound_locked(std::uint64_t bytes) REQUIRES(mu_);

  const Limits limits_;
  Wake agree_wake_, work_wake_;
  Mutex mu_;  // never held across I/O or a wait
  std::deque<StorageWork> agreeing_ GUARDED_BY(mu_);  // phase 1, ring order
  std::deque<Prepared> high_ GUARDED_BY(mu_);         // phase 2: loads first,
  std::deque<Prepared> low_ GUARDED_BY(mu_);          // then writes
  bool agree_done_ GUARDED_BY(mu_) = false;           // phase 1 has exited (after closing)
  bool closing_ GUARDED_BY(mu_) = false;
  std::unordered_set<std::uint64_t> live_ GUARDED_BY(mu_);       // queued or running task ids
  std::unordered_set<std::uint64_t> cancelled_ GUARDED_BY(mu_);  // subset of live
  std::unordered_set<std::uint64_t> committed_ GUARDED_BY(mu_);  // subset of live: past their last cancel check
  std::uint64_t backup_queued_ GUARDED_BY(mu_) = 0;
  std::uint32_t writes_running_ GUARDED_BY(mu_) = 0;
  std::int64_t agreeing_since_ns_ GUARDED_BY(mu_) = 0;  // when phase 1 of the current task began (0: idle)
};

}  // namespace kvtd::daemon
