#include "serve/block_tracker.h"

#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"

namespace kvtd::daemon {

BlockTracker::BlockTracker(std::int64_t host_blocks, std::int64_t device_blocks) {
  MutexLock g(mu_);
  for (int lane = 0; lane < kLanes; ++lane) {
    host_[lane].readers.assign(static_cast<std::size_t>(host_blocks), 0);
    host_[lane].writers.assign(static_cast<std::size_t>(host_blocks), 0);
    device_[lane].readers.assign(static_cast<std::size_t>(device_blocks), 0);
    device_[lane].writers.assign(static_cast<std::size_t>(device_blocks), 0);
  }
}

namespace {

// Whether `ids` (read only when `reads`) collide with what `side` has in flight: a write meets
// any reader or writer, a read meets writers only.
template <typename Side>
bool collide(const Side& side, std::span<const std::int32_t> ids, bool reads) {
  for (auto id : ids) {
    const auto b = static_cast<std::size_t>(id);
    if (side.writers[b] || (!reads && side.readers[b])) return true;
  }
  return false;
}

template <typename Side>
void count(Side& side, std::span<const std::int32_t> ids, bool reads, int delta) {
  auto& counts = reads ? side.readers : side.writers;
  for (auto id : ids) counts[static_cast<std::size_t>(id)] += static_cast<std::uint32_t>(delta);
}

}  // namespace

bool BlockTracker::conflicts(const TrackedTask& t, int lane) const {
  for (int other = 0; other < kLanes; ++other) {
    if (other == lane && lane != kStorageLane) continue;
    if (t.after_task_id != 0) {
      auto it = inflight_tasks_.find(t.after_task_id);
      if (it != inflight_tasks_.end() && it->second == other) return true;
    }
    if (collide(host_[other], t.host_ids, t.reads_host) || collide(device_[other], t.device_ids, t.reads_device))
      return true;
  }
  return false;
}

void BlockTracker::track(const TrackedTask& t, int lane, int delta) {
  count(host_[lane], t.host_ids, t.reads_host, delta);
  count(device_[lane], t.device_ids, t.reads_device, delta);
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
