// The storage executor: its facade, its two queues and their threads.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/storage/object_format.h"
#include "kvtd/storage/object_store.h"
#include "executor_impl.h"

namespace kvtd::daemon {

std::uint64_t layout_fingerprint(const proto::CacheGeometry& g) {
  // Only what shapes an object's bytes; fixed-width fields hashed in a fixed order.
  // f[3] was a constant 2 before scale sizes varied and f[10] was 0 before extra layers: the
  // fingerprint of every earlier geometry is unchanged, so what was stored stays readable.
  std::uint64_t f[12] = {g.dtype, g.num_layers, g.num_ranks, g.has_scales() ? g.scale_element_bytes() : 2u};
  f[10] = g.num_extra_layers;
  for (int i = 1; i < 4; ++i) {
    f[3 + i] = static_cast<std::uint64_t>(g.key_shape[i]);
    f[6 + i] = static_cast<std::uint64_t>(g.value_shape[i]);
  }
  f[11] = 0x6b767464u;  // "kvtd": a version of this recipe
  return storage::hash_bytes(f, sizeof f);
}

std::uint32_t storage_io_threads(const config::StorageConfig& c, std::uint64_t object_bytes, unsigned cpus) {
  if (c.io_threads != 0) return c.io_threads;
  std::uint64_t n = std::clamp<std::uint64_t>(cpus / 2, 2, 8);
  if (object_bytes != 0) n = std::min<std::uint64_t>(n, std::max<std::uint64_t>(1, (c.staging_mib << 20) / object_bytes));
  return static_cast<std::uint32_t>(n);
}

std::string staging_problem(const config::StorageConfig& c, std::uint64_t object_bytes) {
  const std::uint32_t threads = storage_io_threads(c, object_bytes, std::thread::hardware_concurrency());
  const std::uint64_t per_worker = (c.staging_mib << 20) / threads;
  if (object_bytes != 0 && per_worker >= object_bytes) return "";
  return "--storage-staging-mib " + std::to_string(c.staging_mib) + " over " + std::to_string(threads) +
         " --storage-io-threads gives each worker " + std::to_string(per_worker) +
         " bytes, less than one stored object (" + std::to_string(object_bytes) +
         " bytes: one block, every layer); raise the staging or lower the threads";
}

void StorageExecutor::Impl::forget(const StorageWork& w) {
  {
    MutexLock g(mu);
    live.erase(w.header.task_id);
    cancelled.erase(w.header.task_id);
    committed.erase(w.header.task_id);
  }
  release(w);
}

std::string StorageExecutor::Impl::backup_skip_reason(const StorageWork& w, std::uint64_t bytes, std::int64_t now) {
  const std::int64_t age_ms = (now - w.header.submit_ns) / 1'000'000;
  if (age_ms > static_cast<std::int64_t>(t.config.backup_max_age_ms))
    return "backup skipped: it waited " + std::to_string(age_ms) + " ms for the store (--storage-backup-max-age-ms " +
           std::to_string(t.config.backup_max_age_ms) + ")";
  MutexLock g(mu);
  return over_queue_bound(bytes);
}

std::string StorageExecutor::Impl::over_queue_bound(std::uint64_t bytes) {
  // One backup larger than the whole bound still goes when nothing else waits.
  if (backup_queued != 0 && backup_queued + bytes > (t.config.backup_queue_mib << 20))
    return "backup skipped: " + std::to_string(backup_queued >> 20) + " MiB of backups wait for the store " +
           "(--storage-backup-queue-mib " + std::to_string(t.config.backup_queue_mib) + ")";
  return "";
}

void StorageExecutor::Impl::answer_skipped(const StorageWork& w, std::int64_t start, const std::string& why,
                                           bool new_task) {
  {
    MutexLock g(stats_mu);
    st.tasks += new_task;
    ++st.backups_skipped;
  }
  finish(w, proto::Outcome::failed(TaskStatus::kBackupSkipped, why).with_skipped(w.section.keys.size()), start);
}

std::string StorageExecutor::Impl::skip_on_arrival(const StorageWork& w, std::int64_t now) {
  const std::int64_t max_age_ns = static_cast<std::int64_t>(t.config.backup_max_age_ms) * 1'000'000;
  // The oldest of: the task phase 1 is busy with, and the first one waiting for it.
  std::int64_t held_since = agreeing_since_ns;
  if (!agreeing.empty() && (held_since == 0 || agreeing.front().header.submit_ns < held_since))
    held_since = agreeing.front().header.submit_ns;
  if (held_since != 0 && now - held_since > max_age_ns)
    return "backup skipped: the store has held storage tasks for " + std::to_string((now - held_since) / 1'000'000) +
           " ms (--storage-backup-max-age-ms " + std::to_string(t.config.backup_max_age_ms) + ")";
  return over_queue_bound(w.section.keys.size() * t.object_bytes);
}

void StorageExecutor::Impl::skip_before_agreement(const StorageWork& w, std::int64_t now, const std::string& why) {
  abort_agreement(w, TaskStatus::kBackupSkipped);
  ep.leave_agreements(w.header.seq + 1);
  answer_skipped(w, now, why, /*new_task=*/true);
}

void StorageExecutor::Impl::agreement_loop() {
  for (;;) {
    Prepared p;
    const bool got = wait_for(agree_wake, [&]() REQUIRES(mu) -> std::optional<bool> {
      if (!agreeing.empty()) {
        p.work = std::move(agreeing.front());
        agreeing.pop_front();
        agreeing_since_ns = ipc::monotonic_now_ns();
        return true;
      }
      if (closing) return false;
      return std::nullopt;
    });
    if (!got) break;
    const bool backup = is_backup(p.work) && !p.work.answered && t.store != nullptr;
    if (backup) {
      const std::int64_t now = ipc::monotonic_now_ns();
      const auto why = backup_skip_reason(p.work, p.work.section.keys.size() * t.object_bytes, now);
      if (!why.empty() && !revoked(p.work)) {
        skip_before_agreement(p.work, now, why);
        forget(p.work);
        continue;
      }
    }
    const bool go_on = agree_phase(p);
    {
      MutexLock g(mu);
      agreeing_since_ns = 0;
    }
    if (!go_on) {
      forget(p.work);
      continue;
    }
    const bool write = static_cast<TaskKind>(p.work.header.kind) == TaskKind::kStorageWrite;
    {
      MutexLock g(mu);
      p.queued_ns = ipc::monotonic_now_ns();
      if (backup) {
        p.backup_bytes = (p.stored.size() - p.agreed) * t.object_bytes;
        backup_queued += p.backup_bytes;
      }
      (write ? low : high).push_back(std::move(p));
    }
    work_wake.bump();
  }
  {
    MutexLock g(mu);
    agree_done = true;
  }
  work_wake.bump();
}

void StorageExecutor::Impl::worker_loop(std::size_t index) {
  start_copy_thread(("kvtd-io" + std::to_string(index)).c_str(), t.numa_node);
  std::byte* slice = staging[index];
  for (;;) {
    Prepared p;
    bool write = false;
    const bool got = wait_for(work_wake, [&]() REQUIRES(mu) -> std::optional<bool> {
      write = high.empty() && !low.empty() && writes_running < write_workers;
      auto& q = write ? low : high;
      if (!q.empty()) {
        p = std::move(q.front());
        q.pop_front();
        writes_running += write;
        return true;
      }
      // Closing, and nothing more can be handed over (queued writes wait for a write worker).
      if (agree_done && high.empty() && low.empty()) return false;
      return std::nullopt;
    });
    if (!got) return;
    if (!revoked(p.work)) {
      if (write) run_write(p, slice);
      else run_load(p, slice);
    }
    if (write) {
      MutexLock g(mu);
      --writes_running;
      backup_queued -= p.backup_bytes;
    }
    if (write) work_wake.bump();  // a write worker is free: a queued write may go
    forget(p.work);
  }
}


Result<std::unique_ptr<StorageExecutor>, StorageExecutor::SetupErrc> StorageExecutor::create(endpoint::RankEndpoint& ep, CopyEngine& backend, HostMemory& host_memory,
                                                                              HostPool* pool, StorageTargets targets,
                                                                              Complete complete, Release release) {
  auto impl = std::make_unique<Impl>(ep, backend, pool, std::move(targets), std::move(complete), std::move(release));
  auto& t = impl->t;
  const std::uint64_t threads = storage_io_threads(t.config, t.object_bytes, std::thread::hardware_concurrency());
  t.config.io_threads = static_cast<std::uint32_t>(threads);  // what the workers and cancel steps count on
  const std::uint64_t staging_bytes = t.config.staging_mib << 20;
  const std::uint64_t per_worker = staging_bytes / threads;
  if (t.store != nullptr) {
    if (auto why = staging_problem(t.config, t.object_bytes); !why.empty())
      return make_error(SetupErrc::kStagingTooSmall, why);
  }
  impl->write_workers = static_cast<std::uint32_t>(std::max<std::uint64_t>(1, threads - 1));
  impl->chunk_objects = t.object_bytes == 0 ? 0 : static_cast<std::size_t>(per_worker / t.object_bytes);
  // Staging exists only when there is a store to move objects through.
  const std::size_t slice_bytes = t.store ? impl->chunk_objects * t.object_bytes : 0;
  for (std::uint64_t i = 0; i < threads; ++i) {
    std::byte* p = nullptr;
    if (slice_bytes != 0) {
      auto a = HostBuffer::allocate(host_memory, slice_bytes);
      if (!a.ok()) return make_error(SetupErrc::kNoMemory, "storage staging: " + a.error().message);
      p = a->data();
      impl->staging_memory.push_back(std::move(a).value());  // returned when the executor ends
    }
    impl->staging.push_back(p);
  }
  auto* raw = impl.get();
  raw->agreement = std::thread([raw] { raw->agreement_loop(); });
  for (std::uint64_t i = 0; i < threads; ++i) raw->workers.emplace_back([raw, i] { raw->worker_loop(i); });
  return std::unique_ptr<StorageExecutor>(new StorageExecutor(std::move(impl)));
}

StorageExecutor::StorageExecutor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StorageExecutor::~StorageExecutor() { close(); }

void StorageExecutor::close() {
  {
    MutexLock g(impl_->mu);
    impl_->closing = true;
  }
  impl_->agree_wake.bump();
  if (impl_->agreement.joinable()) impl_->agreement.join();
  impl_->work_wake.bump();  // idle workers see `closing` now, not at the end of their wait slice
  for (auto& th : impl_->workers)
    if (th.joinable()) th.join();
}

void StorageExecutor::submit(StorageWork&& w) {
  auto* impl = impl_.get();
  std::string skip;
  const std::int64_t now = ipc::monotonic_now_ns();
  {
    MutexLock g(impl->mu);
    if (is_backup(w) && !w.answered && impl->t.store != nullptr) skip = impl->skip_on_arrival(w, now);
    if (skip.empty()) {
      impl->live.insert(w.header.task_id);
      impl->agreeing.push_back(std::move(w));
    }
  }
  if (skip.empty()) {
    impl->agree_wake.bump();
    return;
  }
  skip_backup(std::move(w), skip);
}

void StorageExecutor::skip_backup(StorageWork&& w, const std::string& why) {
  auto* impl = impl_.get();
  // Answered now, so the engine may reuse its host blocks; its agreement is left in ring order.
  impl->answer_skipped(w, ipc::monotonic_now_ns(), why, /*new_task=*/true);
  impl->release(w);
  w.blocks.clear();
  w.answered = TaskStatus::kBackupSkipped;
  {
    MutexLock g(impl->mu);
    impl->agreeing.push_back(std::move(w));
  }
  impl->agree_wake.bump();
}

bool StorageExecutor::cancel(std::uint64_t task_id) {
  MutexLock g(impl_->mu);
  // Past its last check the task will complete as it is: saying it stops would be a lie.
  if (!impl_->live.count(task_id) || impl_->committed.count(task_id)) return false;
  impl_->cancelled.insert(task_id);
  return true;
}

std::size_t StorageExecutor::drop_queued() {
  std::deque<StorageWork> dropped;
  {
    MutexLock g(impl_->mu);
    auto take = [&](StorageWork&& w) REQUIRES(impl_->mu) {
      impl_->live.erase(w.header.task_id);
      impl_->cancelled.erase(w.header.task_id);
      impl_->committed.erase(w.header.task_id);
      dropped.push_back(std::move(w));
    };
    for (auto& w : impl_->agreeing) take(std::move(w));
    impl_->agreeing.clear();
    for (auto* q : {&impl_->high, &impl_->low}) {
      for (auto& p : *q) {
        impl_->backup_queued -= p.backup_bytes;
        take(std::move(p.work));
      }
      q->clear();
    }
  }
  for (auto& w : dropped) impl_->release(w);
  return dropped.size();
}

StorageStats StorageExecutor::stats() const {
  MutexLock g(impl_->stats_mu);
  return impl_->st;
}

}  // namespace kvtd::daemon
