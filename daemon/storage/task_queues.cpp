// The storage executor's queues and task sets.
#include "task_queues.h"

#include <fmt/format.h>

#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"

namespace kvtd::daemon {

void TaskQueues::Wake::bump() { ipc::bump_and_wake(word, &waiters); }

template <typename Take>
bool TaskQueues::wait_for(Wake& wake, Take&& take) {
  for (;;) {
    const std::uint32_t seen = wake.word.load(std::memory_order_acquire);
    {
      MutexLock g(mu_);
      if (auto r = take(); r.has_value()) return *r;
    }
    (void)ipc::wait_on_word(wake.word, seen, ipc::monotonic_now_ns() + 50'000'000, &wake.waiters, 50'000);
  }
}

std::string TaskQueues::admit(StorageWork& w, std::optional<std::uint64_t> backup_bytes, std::int64_t now) {
  {
    MutexLock g(mu_);
    if (backup_bytes) {
      // The oldest of: the task phase 1 is busy with, and the first one waiting for it.
      std::int64_t held_since = agreeing_since_ns_;
      if (!agreeing_.empty() && (held_since == 0 || agreeing_.front().header.submit_ns < held_since))
        held_since = agreeing_.front().header.submit_ns;
      if (held_since != 0 && now - held_since > limits_.backup_max_age_ns)
        return fmt::format("backup skipped: the store has held storage tasks for {} ms "
                           "(--storage-backup-max-age-ms {})",
                           (now - held_since) / 1'000'000, limits_.backup_max_age_ns / 1'000'000);
      if (auto why = over_backup_bound_locked(*backup_bytes); !why.empty()) return why;
    }
    live_.insert(w.header.task_id);
    agreeing_.push_back(std::move(w));
  }
  agree_wake_.bump();
  return "";
}

void TaskQueues::push_answered(StorageWork&& w) {
  {
    MutexLock g(mu_);
    agreeing_.push_back(std::move(w));
  }
  agree_wake_.bump();
}

std::optional<StorageWork> TaskQueues::next_to_agree() {
  std::optional<StorageWork> out;
  (void)wait_for(agree_wake_, [&]() REQUIRES(mu_) -> std::optional<bool> {
    if (!agreeing_.empty()) {
      out = std::move(agreeing_.front());
      agreeing_.pop_front();
      agreeing_since_ns_ = ipc::monotonic_now_ns();
      return true;
    }
    if (closing_) return false;
    return std::nullopt;
  });
  return out;
}

void TaskQueues::agreement_finished() {
  MutexLock g(mu_);
  agreeing_since_ns_ = 0;
}

std::string TaskQueues::over_backup_bound(std::uint64_t bytes) {
  MutexLock g(mu_);
  return over_backup_bound_locked(bytes);
}

std::string TaskQueues::over_backup_bound_locked(std::uint64_t bytes) {
  // One backup larger than the whole bound still goes when nothing else waits.
  if (backup_queued_ != 0 && backup_queued_ + bytes > limits_.backup_queue_bytes)
    return fmt::format("backup skipped: {} MiB of backups wait for the store (--storage-backup-queue-mib {})",
                       backup_queued_ >> 20, limits_.backup_queue_bytes >> 20);
  return "";
}

void TaskQueues::to_objects(Prepared&& p) {
  const bool write = static_cast<proto::TaskKind>(p.work.header.kind) == proto::TaskKind::kStorageWrite;
  {
    MutexLock g(mu_);
    p.queued_ns = ipc::monotonic_now_ns();
    backup_queued_ += p.backup_bytes;
    (write ? low_ : high_).push_back(std::move(p));
  }
  work_wake_.bump();
}

void TaskQueues::agreement_ended() {
  {
    MutexLock g(mu_);
    agree_done_ = true;
  }
  work_wake_.bump();
}

std::optional<TaskQueues::Job> TaskQueues::next_to_move() {
  std::optional<Job> out;
  (void)wait_for(work_wake_, [&]() REQUIRES(mu_) -> std::optional<bool> {
    const bool write = high_.empty() && !low_.empty() && writes_running_ < limits_.write_workers;
    auto& q = write ? low_ : high_;
    if (!q.empty()) {
      out = Job{std::move(q.front()), write};
      q.pop_front();
      writes_running_ += write;
      return true;
    }
    // Closing, and nothing more can be handed over (queued writes wait for a write worker).
    if (agree_done_ && high_.empty() && low_.empty()) return false;
    return std::nullopt;
  });
  return out;
}

void TaskQueues::moved(const Job& job) {
  if (!job.write) return;
  {
    MutexLock g(mu_);
    --writes_running_;
    backup_queued_ -= job.p.backup_bytes;
  }
  work_wake_.bump();  // a write worker is free: a queued write may go
}

void TaskQueues::forget(std::uint64_t task_id) {
  MutexLock g(mu_);
  live_.erase(task_id);
  cancelled_.erase(task_id);
  committed_.erase(task_id);
}

bool TaskQueues::cancel(std::uint64_t task_id) {
  MutexLock g(mu_);
  // Past its last check the task will complete as it is: saying it stops would be a lie.
  if (!live_.count(task_id) || committed_.count(task_id)) return false;
  cancelled_.insert(task_id);
  return true;
}

bool TaskQueues::is_cancelled(std::uint64_t task_id) {
  MutexLock g(mu_);
  return cancelled_.count(task_id) != 0;
}

bool TaskQueues::may_continue(std::uint64_t task_id, bool last_step) {
  MutexLock g(mu_);
  if (cancelled_.count(task_id) != 0) return false;
  if (last_step) committed_.insert(task_id);
  return true;
}

std::vector<StorageWork> TaskQueues::drop_queued() {
  std::vector<StorageWork> dropped;
  MutexLock g(mu_);
  auto take = [&](StorageWork&& w) REQUIRES(mu_) {
    live_.erase(w.header.task_id);
    cancelled_.erase(w.header.task_id);
    committed_.erase(w.header.task_id);
    dropped.push_back(std::move(w));
  };
  for (auto& w : agreeing_) take(std::move(w));
  agreeing_.clear();
  for (auto* q : {&high_, &low_}) {
    for (auto& p : *q) {
      backup_queued_ -= p.backup_bytes;
      take(std::move(p.work));
    }
    q->clear();
  }
  return dropped;
}

void TaskQueues::close() {
  {
    MutexLock g(mu_);
    closing_ = true;
  }
  agree_wake_.bump();
}

}  // namespace kvtd::daemon
