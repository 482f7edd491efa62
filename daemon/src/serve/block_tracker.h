// block_tracker.h (daemon-internal) - which blocks each lane has in flight, so that work on the
// same block runs in submission order across lanes: an eviction (to host) and a later load (to
// device) of the same host block, or a swap and the storage task that reads its blocks.
//
// A task conflicts with another lane's task when one of them writes a block the other touches,
// or when it names the other's task id as its after-task; two tasks that only read a block do
// not conflict (a load from a host block runs beside the backup that reads it). Tasks on the
// same swap lane never conflict (the lane runs them in order); the storage lane conflicts with
// itself the same way (its workers keep no order).
//
// Thread-safety: every method from any thread; admit() and wait_until_idle() wait without the
// lock, on a futex word every release bumps.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvtd/base/mutex.h"

namespace kvtd::daemon {

// The blocks and ids of one task, as the tracker sees them.
struct TrackedTask {
  std::uint64_t task_id = 0;
  std::uint64_t after_task_id = 0;  // 0: none
  std::span<const std::int32_t> host_ids;
  std::span<const std::int32_t> device_ids;
  bool reads_host = false;    // it only reads its host blocks (else it writes them)
  bool reads_device = false;  // it only reads its device blocks
};

class BlockTracker {
 public:
  static constexpr int kToHostLane = 0, kToDeviceLane = 1, kStorageLane = 2, kLanes = 3;

  // Ids must be within [0, host_blocks) and [0, device_blocks) (the decoder checked them).
  BlockTracker(std::int64_t host_blocks, std::int64_t device_blocks);
  BlockTracker(const BlockTracker&) = delete;
  BlockTracker& operator=(const BlockTracker&) = delete;

  // Records `t` in flight on `lane` unless it conflicts; false (nothing recorded) if it does.
  bool try_admit(const TrackedTask& t, int lane) EXCLUDES(mu_);
  // Waits while `t` conflicts, then records it. The work it waits for always finishes, so this
  // ends; `slice_ns` only bounds each sleep.
  void admit(const TrackedTask& t, int lane, std::int64_t slice_ns) EXCLUDES(mu_);
  // `t` left `lane` (done or dropped): wakes the waiters.
  void release(const TrackedTask& t, int lane) EXCLUDES(mu_);
  bool idle() const EXCLUDES(mu_);
  // Waits until no task is in flight on any lane; `tick` runs every `slice_ns` meanwhile.
  void wait_until_idle(std::int64_t slice_ns, const std::function<void()>& tick) EXCLUDES(mu_);

 private:
  bool conflicts(const TrackedTask& t, int lane) const REQUIRES(mu_);
  void track(const TrackedTask& t, int lane, int delta) REQUIRES(mu_);

  mutable Mutex mu_;
  // Per lane and block: how many tasks in flight read it, how many write it. Counts, not flags:
  // one lane may hold many tasks on a block (32 bits: no realistic queue wraps).
  struct Side {
    std::vector<std::uint32_t> readers, writers;
  };
  Side host_[kLanes] GUARDED_BY(mu_);
  Side device_[kLanes] GUARDED_BY(mu_);
  std::unordered_map<std::uint64_t, int> inflight_tasks_ GUARDED_BY(mu_);  // task id -> lane
  std::atomic<std::uint32_t> word_{0};
  std::atomic<std::uint32_t> waiters_{0};
};

}  // namespace kvtd::daemon
