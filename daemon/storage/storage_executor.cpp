// The storage executor: its facade and its threads (phase 1's agreement thread, phase 2's workers).
#include <algorithm>
#include <fmt/format.h>
#include <thread>

#include "executor_impl.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/storage/object_format.h"

namespace kvtd::daemon {

namespace {

// The identity's share of a namespace: nothing when neither a dtype nor a stage is declared, so a
// namespace stored before identities existed keeps its fingerprint. The dtype by its name's hash,
// the stage and slice as rank and size, under a recipe tag of their own ("kvtdI").
std::uint64_t with_identity(std::uint64_t fingerprint, const proto::KvIdentity& id) {
  const std::string dtype = id.dtype_name();
  if (dtype.empty() && !id.staged()) return fingerprint;
  const std::uint64_t f[7] = {fingerprint, 0x6b76746449ull << 8, storage::hash_bytes(dtype.data(), dtype.size()),
                              id.pp_rank, proto::stage_size(id.pp_size), id.cp_rank, proto::stage_size(id.cp_size)};
  return storage::hash_bytes(f, sizeof f);
}

}  // namespace

std::uint64_t layout_fingerprint(const proto::CacheGeometry& g, const proto::ObjectSlicing& slicing,
                                 const proto::KvIdentity& id) {
  // Only what shapes an object's bytes; fixed-width fields hashed in a fixed order.
  // f[3] was a constant 2 before scale sizes varied and f[10] was 0 before extra layers: the
  // fingerprint of every earlier geometry stored by rank is unchanged, so what was stored stays
  // readable. Objects by head and replicated ones get their own recipe tags (f[11]), which no
  // TP size enters.
  std::uint64_t f[12] = {g.dtype, g.num_layers, g.num_ranks, g.has_scales() ? g.scale_element_bytes() : 2u};
  f[10] = g.num_extra_layers;
  for (int i = 1; i < 4; ++i) {
    f[3 + i] = static_cast<std::uint64_t>(g.key_shape[i]);
    f[6 + i] = static_cast<std::uint64_t>(g.value_shape[i]);
  }
  f[11] = 0x6b767464u;  // "kvtd": a version of this recipe
  if (slicing.replicated) {
    f[2] = 0;
    f[11] = 0x6b76746452ull << 8;  // "kvtdR": one copy for every TP size
  } else if (slicing.by_head) {
    f[2] = slicing.total_heads;
    f[4] = f[7] = slicing.heads_per_part;  // an object's heads, not a rank's
    f[11] = 0x6b76746448ull << 8;  // "kvtdH": objects of heads_per_part heads
  }
  return with_identity(storage::hash_bytes(f, sizeof f), id);
}

std::uint64_t group_fingerprint(const proto::CacheGroups& gs, std::uint32_t g, const proto::KvIdentity& id) {
  // Fixed-width fields in a fixed order, under a recipe tag of their own ("kvtdG") that no
  // single-shape geometry's hash starts from.
  const proto::CacheGroup& c = gs.groups[g];
  std::uint64_t f[8 + proto::kLayerWords + 4 * proto::kMaxGroupTensors] = {
      0x6b76746447ull << 8, c.kind, c.num_tensors, c.block_tokens, c.window_tokens, gs.page_tokens,
      proto::group_replicated(gs, g) ? 0u : gs.num_ranks, 0};
  std::size_t at = 8;
  for (std::uint64_t w : c.layers) f[at++] = w;
  for (std::uint32_t t = 0; t < proto::kMaxGroupTensors; ++t) {
    const proto::GroupTensor& x = c.tensors[t];
    f[at++] = std::uint64_t{x.element_bytes} << 32 | x.ndim;
    for (std::uint32_t d = 0; d < proto::kMaxGroupTensorDims; ++d) f[at++] = static_cast<std::uint64_t>(x.dims[d]);
  }
  return with_identity(storage::hash_bytes(f, sizeof f), id);
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
  return fmt::format("--storage-staging-mib {} over {} --storage-io-threads gives each worker {} bytes, "
                     "less than one block's stored objects ({} bytes: one block, every layer); "
                     "raise the staging or lower the threads",
                     c.staging_mib, threads, per_worker, object_bytes);
}

void StorageExecutor::Impl::finish(const StorageWork& w, const proto::Outcome& o, std::int64_t start, bool new_task) {
  if (o.status == TaskStatus::kBackupSkipped) {
    MutexLock g(stats_mu);
    tasks += new_task;
    ++backups_skipped;
  }
  listener.storage_completed(w.header, o, start);
}

std::string StorageExecutor::Impl::backup_skip_reason(const StorageWork& w, std::int64_t now) {
  const std::int64_t age_ms = (now - w.header.submit_ns) / 1'000'000;
  if (age_ms > static_cast<std::int64_t>(t.config.backup_max_age_ms))
    return fmt::format("backup skipped: it waited {} ms for the store (--storage-backup-max-age-ms {})", age_ms,
                       t.config.backup_max_age_ms);
  return queues.over_backup_bound(w.section.keys.size() * t.key_bytes());
}

void StorageExecutor::Impl::skip_before_agreement(const StorageWork& w, std::int64_t now, const std::string& why) {
  abort_agreement(w, TaskStatus::kBackupSkipped);
  ep.leave_agreements(w.header.seq + 1);
  finish(w, proto::Outcome::failed(TaskStatus::kBackupSkipped, why).with_skipped(w.section.keys.size()), now,
         /*new_task=*/true);
}

void StorageExecutor::Impl::agreement_loop() {
  while (auto next = queues.next_to_agree()) {
    Prepared p;
    p.work = std::move(*next);
    const bool backup = is_backup(p.work) && !p.work.answered && t.store != nullptr;
    if (backup) {
      const std::int64_t now = ipc::monotonic_now_ns();
      const auto why = backup_skip_reason(p.work, now);
      if (!why.empty() && !revoked(p.work)) {
        skip_before_agreement(p.work, now, why);
        queues.agreement_finished();
        forget(p.work);
        continue;
      }
    }
    const bool go_on = agree_phase(p);
    queues.agreement_finished();
    if (!go_on) {
      forget(p.work);
      continue;
    }
    if (backup) p.backup_bytes = (p.which.size() - p.agreed) * t.key_bytes();
    queues.to_objects(std::move(p));
  }
  queues.agreement_ended();
}

void StorageExecutor::Impl::worker_loop(std::size_t index) {
  start_copy_thread(fmt::format("kvtd-io{}", index).c_str(), t.numa_node);
  std::byte* slice = staging[index];
  while (auto job = queues.next_to_move()) {
    const auto& p = job->p;
    if (!revoked(p.work)) {
      // nullopt: revoked mid-way, the engine has failed it already (no completion).
      if (auto outcome = job->write ? mover.write(p, slice) : mover.load(p, slice)) finish(p.work, *outcome, p.start);
    }
    queues.moved(*job);
    forget(p.work);
  }
}

Result<std::unique_ptr<StorageExecutor>, StorageExecutor::SetupErrc> StorageExecutor::create(
    endpoint::RankEndpoint& ep, CopyEngine& copies, HostMemory& host_memory, HostPool* pool, StorageTargets t,
    StorageListener& listener) {
  const std::uint64_t threads = storage_io_threads(t.config, t.staged_bytes(), std::thread::hardware_concurrency());
  t.config.io_threads = static_cast<std::uint32_t>(threads);  // what the workers and cancel steps count on
  const std::uint64_t per_worker = (t.config.staging_mib << 20) / threads;
  if (t.store != nullptr) {
    if (auto why = staging_problem(t.config, t.staged_bytes()); !why.empty())
      return make_error(SetupErrc::kStagingTooSmall, why);
  }
  TaskQueues::Limits limits;
  limits.write_workers = static_cast<std::uint32_t>(std::max<std::uint64_t>(1, threads - 1));
  limits.backup_queue_bytes = t.config.backup_queue_mib << 20;
  limits.backup_max_age_ns = static_cast<std::int64_t>(t.config.backup_max_age_ms) * 1'000'000;
  const std::size_t chunk_objects = t.object_bytes == 0 ? 0 : static_cast<std::size_t>(per_worker / t.object_bytes);
  // Staging exists only when there is a store to move objects through.
  const std::size_t slice_bytes = t.store ? chunk_objects * t.object_bytes : 0;
  auto impl = std::make_unique<Impl>(ep, copies, pool, std::move(t), listener, chunk_objects, limits);
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
  impl_->queues.close();
  if (impl_->agreement.joinable()) impl_->agreement.join();
  impl_->queues.wake_workers();  // idle workers see the end now, not at the end of their wait slice
  for (auto& th : impl_->workers)
    if (th.joinable()) th.join();
}

void StorageExecutor::submit(StorageWork&& w) {
  auto* impl = impl_.get();
  std::optional<std::uint64_t> backup_bytes;
  if (is_backup(w) && !w.answered && impl->t.store != nullptr) backup_bytes = w.section.keys.size() * impl->t.key_bytes();
  const auto skip = impl->queues.admit(w, backup_bytes, ipc::monotonic_now_ns());
  if (!skip.empty()) skip_backup(std::move(w), skip);
}

void StorageExecutor::skip_backup(StorageWork&& w, const std::string& why) {
  auto* impl = impl_.get();
  // Answered now, so the engine may reuse its host blocks; its agreement is left in ring order.
  impl->finish(w, proto::Outcome::failed(TaskStatus::kBackupSkipped, why).with_skipped(w.section.keys.size()),
               ipc::monotonic_now_ns(), /*new_task=*/true);
  impl->listener.storage_released(w);
  w.blocks.clear();
  w.answered = TaskStatus::kBackupSkipped;
  impl->queues.push_answered(std::move(w));
}

bool StorageExecutor::cancel(std::uint64_t task_id) { return impl_->queues.cancel(task_id); }

std::size_t StorageExecutor::drop_queued() {
  auto dropped = impl_->queues.drop_queued();
  for (auto& w : dropped) impl_->listener.storage_released(w);
  return dropped.size();
}

StorageStats StorageExecutor::stats() const {
  const auto moved = impl_->mover.stats();
  StorageStats s;
  s.objects_read = moved.objects_read;
  s.objects_written = moved.objects_written;
  s.bytes_read = moved.bytes_read;
  s.bytes_written = moved.bytes_written;
  MutexLock g(impl_->stats_mu);
  s.tasks = impl_->tasks;
  s.backups_skipped = impl_->backups_skipped;
  return s;
}

}  // namespace kvtd::daemon
