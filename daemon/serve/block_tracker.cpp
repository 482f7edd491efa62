#include "block_tracker.h"

#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"

namespace kvtd::daemon {

BlockTracker::BlockTracker(std::int64_t host_blocks, std::int64_t device_blocks) {
  MutexLock g(mu_);
  lanes_.assign(kLaneCount, BlockCounts(host_blocks, device_blocks));
}

bool BlockTracker::conflicts(const TrackedTask& t, Lane lane) const {
  for (const Lane other : kLanes) {
    if (other == lane && lane != Lane::kStorage) continue;
    if (t.after_task_id != 0) {
      auto it = inflight_tasks_.find(t.after_task_id);
      if (it != inflight_tasks_.end() && it->second == other) return true;
    }
    if (lanes_[index_of(other)].collides(t)) return true;
  }
  return false;
}

void BlockTracker::track(const TrackedTask& t, Lane lane, int delta) {
  auto& counts = lanes_[index_of(lane)];
  if (delta > 0) counts.add(t);
  else counts.remove(t);
  if (delta > 0) inflight_tasks_[t.task_id] = lane;
  else inflight_tasks_.erase(t.task_id);
}

bool BlockTracker::try_admit(const TrackedTask& t, Lane lane) {
  MutexLock g(mu_);
  if (conflicts(t, lane)) return false;
  track(t, lane, +1);
  return true;
}

void BlockTracker::admit(const TrackedTask& t, Lane lane, std::int64_t slice_ns) {
  for (;;) {
    // Read before the check: a release between the check and the sleep changes the word, so the
    // wait returns at once instead of missing it.
    const std::uint32_t seen = word_.load(std::memory_order_acquire);
    if (try_admit(t, lane)) return;
    (void)ipc::wait_on_word(word_, seen, ipc::monotonic_now_ns() + slice_ns, &waiters_, 2'000);
  }
}

void BlockTracker::wait_for_release(std::uint32_t seen, std::int64_t deadline_ns) {
  (void)ipc::wait_on_word(word_, seen, deadline_ns, &waiters_, 2'000);
}

void BlockTracker::release(const TrackedTask& t, Lane lane) {
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
