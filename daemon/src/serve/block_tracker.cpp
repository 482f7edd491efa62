#include "serve/block_tracker.h"

#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"

namespace kvtd::daemon {

BlockTracker::BlockTracker(std::int64_t host_blocks, std::int64_t device_blocks) {
  MutexLock g(mu_);
  for (int lane = 0; lane < kLanes; ++lane) {
    busy_host_[lane].assign(static_cast<std::size_t>(host_blocks), 0);
    busy_device_[lane].assign(static_cast<std::size_t>(device_blocks), 0);
  }
}

bool BlockTracker::conflicts(const TrackedTask& t, int lane) const {
  for (int other = 0; other < kLanes; ++other) {
    if (other == lane && lane != kStorageLane) continue;
    if (t.after_task_id != 0) {
      auto it = inflight_tasks_.find(t.after_task_id);
      if (it != inflight_tasks_.end() && it->second == other) return true;
    }
    for (auto id : t.host_ids)
      if (busy_host_[other][static_cast<std::size_t>(id)]) return true;
    for (auto id : t.device_ids)
      if (busy_device_[other][static_cast<std::size_t>(id)]) return true;
  }
  return false;
}

void BlockTracker::track(const TrackedTask& t, int lane, int delta) {
  for (auto id : t.host_ids) busy_host_[lane][static_cast<std::size_t>(id)] += static_cast<std::uint32_t>(delta);
  for (auto id : t.device_ids) busy_device_[lane][static_cast<std::size_t>(id)] += static_cast<std::uint32_t>(delta);
  if (delta > 0) inflight_tasks_[t.task_id] = lane;
  else inflight_tasks_.erase(t.task_id);
}

bool BlockTracker::try_admit(const TrackedTask& t, int lane) {
  MutexLock g(mu_);
  if (conflicts(t, lane)) return false;
  track(t, lane, +1);
  return true;
}

void BlockTracker::admit(const TrackedTask& t, int lane, std::int64_t slice_ns) {
  for (;;) {
    // Read before the check: a release between the check and the sleep changes the word, so the
    // wait returns at once instead of missing it.
    const std::uint32_t seen = word_.load(std::memory_order_acquire);
    if (try_admit(t, lane)) return;
    (void)ipc::wait_on_word(word_, seen, ipc::monotonic_now_ns() + slice_ns, &waiters_, 2'000);
  }
}

void BlockTracker::release(const TrackedTask& t, int lane) {
  {
    MutexLock g(mu_);
    track(t, lane, -1);
  }
  ipc::bump_and_wake(word_, &waiters_);  // release: publishes the erased entry to the waiters' acquire
}

bool BlockTracker::idle() const {
  MutexLock g(mu_);
  return inflight_tasks_.empty();
}

void BlockTracker::wait_until_idle(std::int64_t slice_ns, const std::function<void()>& tick) {
  for (;;) {
    const std::uint32_t seen = word_.load(std::memory_order_acquire);
    if (idle()) return;
    if (tick) tick();
    (void)ipc::wait_on_word(word_, seen, ipc::monotonic_now_ns() + slice_ns, &waiters_, 2'000);
  }
}

}  // namespace kvtd::daemon
