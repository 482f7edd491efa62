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
#include <unordered_map>

#include "kvtd/base/mutex.h"
#include "block_counts.h"
#include "lane.h"

namespace kvtd::daemon {

class BlockTracker {
 public:
  // Ids must be within [0, host_blocks) and [0, device_blocks) (the decoder checked them).
  BlockTracker(std::int64_t host_blocks, std::int64_t device_blocks);
  BlockTracker(const BlockTracker&) = delete;
  BlockTracker& operator=(const BlockTracker&) = delete;

  // Records `t` in flight on `lane` unless it conflicts; false (nothing recorded) if it does.
  bool try_admit(const TrackedTask& t, Lane lane) EXCLUDES(mu_);
  // Waits while `t` conflicts, then records it. The work it waits for always finishes, so this
  // ends; `slice_ns` only bounds each sleep.
  void admit(const TrackedTask& t, Lane lane, std::int64_t slice_ns) EXCLUDES(mu_);
  // `t` left `lane` (done or dropped): wakes the waiters.
  void release(const TrackedTask& t, Lane lane) EXCLUDES(mu_);
  bool idle() const EXCLUDES(mu_);
  // Changes with every release: read it before a check, then wait_for_release(seen, ...) sleeps
  // only while nothing was released since (a release in between returns at once).
  std::uint32_t generation() const { return word_.load(std::memory_order_acquire); }
  void wait_for_release(std::uint32_t seen, std::int64_t deadline_ns);
  // Waits until no task is in flight on any lane; `tick` runs every `slice_ns` meanwhile.
  void wait_until_idle(std::int64_t slice_ns, const std::function<void()>& tick) EXCLUDES(mu_);

 private:
  bool conflicts(const TrackedTask& t, Lane lane) const REQUIRES(mu_);
  void track(const TrackedTask& t, Lane lane, int delta) REQUIRES(mu_);

  mutable Mutex mu_;
  std::vector<BlockCounts> lanes_ GUARDED_BY(mu_);  // per lane: the blocks its tasks in flight read and write
  std::unordered_map<std::uint64_t, Lane> inflight_tasks_ GUARDED_BY(mu_);  // task id -> lane
  std::atomic<std::uint32_t> word_{0};
  std::atomic<std::uint32_t> waiters_{0};
};

}  // namespace kvtd::daemon
