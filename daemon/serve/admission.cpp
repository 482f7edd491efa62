// The task runner's admission: decoded tasks admitted by the block tracker, parked while they
// must wait, and started on their lane or the storage executor.
#include "kvtd/daemon/notify.h"
#include "kvtd/ipc/clock.h"
#include "runner_impl.h"

namespace kvtd::daemon {

void TaskRunner::Impl::dispatch(Work&& w, std::int64_t now) {
  const Lane lane = w.storage ? Lane::kStorage : swap_lane_of(static_cast<TaskKind>(w.header.kind));
  if (parked.must_wait(w) || !tracker.try_admit(tracked_task(w), lane)) {
    parked.park(std::move(w), lane);
    park_poll_ns = kParkPollMinNs;
    return;
  }
  start(std::move(w), lane, now);
}

void TaskRunner::Impl::start(Work&& w, Lane lane, std::int64_t now) {
  if (lane == Lane::kStorage) {
    w.storage_work.epoch = w.epoch;
    const std::string not_stored = backup_pair_problem(w);
    if (storage) {
      if (!not_stored.empty()) storage->skip_backup(std::move(w.storage_work), not_stored);
      else storage->submit(std::move(w.storage_work));
    } else {
      sink.abort_agreement(w.header.seq, TaskStatus::kAgreementFailed);
      ep.leave_agreements(w.header.seq + 1);  // no executor: nothing else agrees here
      complete(w.header, proto::Outcome::failed(TaskStatus::kInternal, "storage executor could not start"), now);
      release_storage(w.storage_work);
    }
    return;
  }
  const bool layerwise = (w.header.flags & proto::kTaskFlagLayerwise) != 0;
  if (!layerwise && lanes.idle(lane) && lanes.task_bytes(w) <= kInlineMaxBytes) {
    lanes.run_inline(w, lane);
  } else {
    lanes.enqueue(std::move(w), lane);
  }
}

void TaskRunner::Impl::retry_parked(bool force) {
  if (parked.empty()) return;
  const std::uint32_t generation = tracker.generation();
  if (!force && generation == parked_checked_at) {
    park_poll_ns = std::min(park_poll_ns * 2, kParkPollMaxNs);
    return;
  }
  parked_checked_at = generation;
  const std::int64_t now = ipc::monotonic_now_ns();
  const auto went = parked.release_ready(
      [this](const Work& w, Lane lane) { return tracker.try_admit(tracked_task(w), lane); },
      [this, now](Work&& w, Lane lane) { start(std::move(w), lane, now); });
  if (went != 0) park_poll_ns = kParkPollMinNs;
}

void TaskRunner::Impl::start_all_parked() {
  while (!parked.empty()) {
    const std::uint32_t seen = tracker.generation();
    retry_parked(/*force=*/true);
    if (parked.empty()) return;
    notify_watchdog();
    tracker.wait_for_release(seen, ipc::monotonic_now_ns() + kPollSliceNs);
  }
}

void TaskRunner::Impl::wait_for_parking_room() {
  while (parked.size() >= kMaxParked) {
    const std::uint32_t seen = tracker.generation();
    retry_parked(/*force=*/true);
    if (parked.size() < kMaxParked) return;
    notify_watchdog();
    tracker.wait_for_release(seen, ipc::monotonic_now_ns() + kPollSliceNs);
  }
}

void TaskRunner::Impl::settle_parked(TaskRunner::Exit exit) {
  if (exit == TaskRunner::Exit::kStopped || exit == TaskRunner::Exit::kCleared) {
    start_all_parked();
    return;
  }
  const std::size_t n = parked.take_all().size();
  swap_outcomes.forget_all();  // their backups were dropped with them
  MutexLock g(stats_mu);
  stats.tasks_dropped += n;
}

}  // namespace kvtd::daemon
