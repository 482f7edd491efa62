// The task runner: its facade, the dispatcher loop, decoding and completions.
#include "kvtd/daemon/task_runner.h"

#include <cstring>
#include <fmt/format.h>
#include <string>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"
#include "runner_impl.h"
#include "task_decoder.h"

namespace kvtd::daemon {

TaskRunner::Impl::Impl(endpoint::RankEndpoint& e, DeviceBackend& b, AttachedCache c)
    : ep(e),
      backend(b),
      cache(std::move(c)),
      tracker(cache.host_blocks, cache.device_blocks),
      parked(cache.host_blocks, cache.device_blocks),
      sink(ep, cache.metrics),
      lanes(ep, b, cache, tracker, *this) {
  for (const GroupCache& g : cache.groups)
    group_shapes.push_back(GroupShape{g.device_base, g.device_blocks, g.host_base, g.host_blocks, g.block_bytes});
  // Storage is served for a single-shape session only: its one pool (a group session's storage
  // tasks are refused by the decoder).
  HostPool* const pool = cache.groups.empty() ? nullptr : cache.groups[0].pool;
  auto ex = StorageExecutor::create(ep, b, b, pool, cache.storage, *this);
  if (!ex.ok()) {
    // Storage tasks then fail, naming why; swaps are unaffected.
    KVTD_ERROR("storage tasks disabled: {}", ex.error().message);
    StorageTargets none = cache.storage;
    none.store = nullptr;
    none.no_store_reason = "storage tasks are disabled on this rank: " + ex.error().message;
    ex = StorageExecutor::create(ep, b, b, pool, none, *this);
  }
  MutexLock g(stats_mu);  // no other thread yet; the locks keep the analysis whole
  if (ex.ok()) {
    storage_owned = std::move(ex).value();
    storage = storage_owned.get();
  }
}

void TaskRunner::Impl::complete(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns,
                                std::optional<std::uint64_t> bytes) {
  const auto kind = static_cast<TaskKind>(h.kind);
  if (kind == TaskKind::kSwapToHost && (h.flags & proto::kTaskFlagBackupPair) != 0) swap_outcomes.record(h.task_id, o.status);
  const bool moves = kind != TaskKind::kStorageQuery && kind != TaskKind::kCancel && !proto::is_cache_control_kind(kind);
  {
    MutexLock g(stats_mu);
    if (o.status == TaskStatus::kOk) ++stats.tasks_ok;
    else ++stats.tasks_failed;
    stats.queue_wait_ns_max = std::max(stats.queue_wait_ns_max, CompletionSink::queue_wait_ns(h, start_ns));
  }
  sink.report(h, o, start_ns, bytes ? *bytes : moves ? o.blocks * lanes.block_bytes() : 0);
}

void TaskRunner::Impl::maybe_summarize(RunnerStats& last, std::int64_t& at) {
  if (cache.summary_period_ns <= 0) return;
  const std::int64_t now = ipc::monotonic_now_ns();
  if (now - at < cache.summary_period_ns) return;
  RunnerStats cur;
  {
    MutexLock g(stats_mu);
    cur = stats;
    stats.queue_wait_ns_max = 0;  // a maximum per period
  }
  if (storage) cur.storage = storage->stats();
  const std::uint64_t tasks = cur.tasks_ok + cur.tasks_failed + cur.storage.tasks - last.tasks_ok - last.tasks_failed -
                              last.storage.tasks;
  if (tasks != 0) {
    const double secs = static_cast<double>(now - at) / 1e9;
    KVTD_INFO("last {:.0f} s: {} tasks ok, {} failed; {:.2f} GB to host, {:.2f} GB to device ({:.2f} / {:.2f} GB/s); "
              "storage {} objects read, {} written; longest queue wait {} us",
              secs, cur.tasks_ok - last.tasks_ok, cur.tasks_failed - last.tasks_failed,
              static_cast<double>(cur.bytes_to_host - last.bytes_to_host) / 1e9,
              static_cast<double>(cur.bytes_to_device - last.bytes_to_device) / 1e9,
              static_cast<double>(cur.bytes_to_host - last.bytes_to_host) / 1e9 / secs,
              static_cast<double>(cur.bytes_to_device - last.bytes_to_device) / 1e9 / secs,
              cur.storage.objects_read - last.storage.objects_read,
              cur.storage.objects_written - last.storage.objects_written, cur.queue_wait_ns_max / 1000);
  }
  last = cur;
  at = now;
}

void TaskRunner::Impl::release_storage(const StorageWork& sw) {
  Work w;
  w.header = sw.header;
  // What the decoder tracked: a group session's -1 names no block.
  ((sw.header.flags & proto::kTaskFlagHostBlocks) ? w.host_ids : w.device_ids) = sw.named_blocks();
  tracker.release(tracked_task(w), Lane::kStorage);
}

bool TaskRunner::Impl::decode(const std::vector<std::byte>& rec, Work& w) {
  const std::int64_t now = ipc::monotonic_now_ns();
  auto d = decode_record(rec,
                         CacheShape{cache.device_blocks, cache.host_blocks, group_shapes, ep.rank(),
                                    ep.geometry().num_ranks, cache.group_session},
                         now);
  const std::uint32_t epoch = w.epoch;  // the grant it was read under: not the decoder's to know
  w = std::move(d.work);
  w.epoch = epoch;
  const auto& h = w.header;
  note_backup_pair(h);  // before anything can complete the swap
  switch (d.action) {
    case DecodedRecord::Action::kRun: return true;
    case DecodedRecord::Action::kClear: clear_task = h; return false;  // run() drains and returns kCleared
    case DecodedRecord::Action::kRestore:
      // Mapped from the registry as it is now: the engine made it live before this record, and
      // this rank attached (and read it) after that.
      complete(h, proto::Outcome::done("already serving the restored cache"), now);
      return false;
    case DecodedRecord::Action::kCancel: {
      bool found = false;
      if (auto parked_header = parked.cancel(d.cancel_task_id)) {  // it never started: it stops now
        complete(*parked_header, proto::Outcome::failed(TaskStatus::kCancelled, "cancelled while it waited for work on its blocks"),
                 now);
        found = true;
      } else {
        found = storage && storage->cancel(d.cancel_task_id);
      }
      // blocks_done 1: the task was live here and will stop between objects; 0: nothing to stop.
      complete(h, proto::Outcome::ok(found ? 1 : 0), now);
      return false;
    }
    case DecodedRecord::Action::kFail: break;
  }
  if (d.abort_agreement) sink.abort_agreement(h.seq, d.status);
  complete(h, proto::Outcome::failed(d.status, d.message), now);
  return false;
}

void TaskRunner::Impl::note_backup_pair(const proto::TaskRecordHeader& h) {
  const auto kind = static_cast<TaskKind>(h.kind);
  const bool pair = (h.flags & proto::kTaskFlagBackupPair) != 0;
  if (backup_pair_swap != 0 && !(pair && kind == TaskKind::kStorageWrite && h.after_task_id == backup_pair_swap))
    swap_outcomes.forget(backup_pair_swap);  // its backup did not follow: nothing will take it
  backup_pair_swap = 0;
  if (pair && kind == TaskKind::kSwapToHost) {
    swap_outcomes.expect(h.task_id);
    backup_pair_swap = h.task_id;
  }
}

std::string TaskRunner::Impl::backup_pair_problem(const Work& w) {
  if (w.backup_of_swap == 0) return "";
  const auto swap = swap_outcomes.take(w.backup_of_swap);
  if (swap == TaskStatus::kOk || w.storage_work.answered) return "";
  // Its host blocks hold what was there before (another prefix's KV): never stored under its keys.
  return fmt::format("backup skipped: its swap (task {}) {}, so its host blocks do not hold these keys' KV",
                     w.backup_of_swap,
                     swap ? std::string("ended ") + proto::task_status_name(*swap)
                          : std::string("did not run on this rank"));
}

TaskRunner::Exit TaskRunner::Impl::dispatch_loop(const std::atomic<bool>& stop, const std::atomic<bool>* clear_requested) {
  using Exit = TaskRunner::Exit;
  std::vector<std::byte> record;
  record.reserve(4096);
  std::optional<std::uint64_t> drain_until;
  RunnerStats last_summary = snapshot_stats();
  std::int64_t summary_at = ipc::monotonic_now_ns();
  for (;;) {
    notify_watchdog();
    // The device context is gone: nothing enqueued from now on would run. Stop reading; the
    // engine fails what is left in the ring when this epoch leaves.
    if (backend.broken()) return Exit::kDeviceLost;
    maybe_summarize(last_summary, summary_at);
    if (cache.metrics) cache.metrics->set_ring_depth(ep.ring_published() - ep.ring_read());
    const bool stopping = stop.load(std::memory_order_acquire);
    if (!stopping && clear_requested != nullptr && clear_requested->load(std::memory_order_acquire)) {
      wait_until_idle();
      return Exit::kCleared;
    }
    if (stopping && !drain_until) drain_until = ep.ring_published();
    if (drain_until && ep.ring_read() >= *drain_until) return Exit::kStopped;
    retry_parked();
    wait_for_parking_room();
    const std::int64_t now = ipc::monotonic_now_ns();
    const std::int64_t slice = parked.empty() ? kPollSliceNs : park_poll_ns;
    const auto next = ep.next_task(record, stopping ? now : now + slice);
    if (next == endpoint::RankEndpoint::Next::kTimeout) {
      if (stopping) return Exit::kStopped;
      continue;
    }
    if (next != endpoint::RankEndpoint::Next::kTask) {
      if (auto exit = on_ring_event(next)) return *exit;
      continue;
    }
    Work w;
    w.epoch = ep.epoch();
    if (decode(record, w)) {
      dispatch(std::move(w), now);
    } else if (clear_task) {  // CLEAR_CACHE: everything before it finishes first
      wait_until_idle();
      return Exit::kCleared;
    }
  }
}

std::optional<TaskRunner::Exit> TaskRunner::Impl::on_ring_event(endpoint::RankEndpoint::Next next) {
  using Exit = TaskRunner::Exit;
  if (next == endpoint::RankEndpoint::Next::kLost) return Exit::kSessionLost;
  if (next == endpoint::RankEndpoint::Next::kCorrupt) return Exit::kRingCorrupt;
  const std::size_t dropped = drop_queued();  // kRegranted
  KVTD_WARN("the engine had counted this rank as dead and failed its tasks; dropped {} queued tasks of the "
            "revoked epoch unrun; re-attached as epoch {}",
            dropped, ep.epoch());
  if (ep.cache_live()) return std::nullopt;
  // The engine cleared its cache meanwhile (this rank's CLEAR_CACHE was failed for it): release
  // the mappings before anything else.
  wait_until_idle();
  return Exit::kCleared;
}

void TaskRunner::Impl::shut_down() {
  lanes.close();
  std::unique_ptr<StorageExecutor> executor;
  {
    MutexLock g(stats_mu);
    executor = std::move(storage_owned);
    storage = nullptr;
  }
  if (executor) {
    executor->close();
    MutexLock g(stats_mu);
    storage_final = executor->stats();
  }
}

std::size_t TaskRunner::Impl::drop_queued() {
  std::size_t n = lanes.drop_queued();
  n += parked.take_all().size();  // never admitted: nothing to release
  if (storage) n += storage->drop_queued();
  swap_outcomes.forget_all();  // the revoked epoch's backups will not ask
  if (n != 0) {
    MutexLock g(stats_mu);
    stats.tasks_dropped += n;
  }
  return n;
}

void TaskRunner::Impl::wait_until_idle() {
  start_all_parked();
  tracker.wait_until_idle(kPollSliceNs, [] { notify_watchdog(); });
}

RunnerStats TaskRunner::Impl::snapshot_stats() const {
  MutexLock g(stats_mu);
  RunnerStats s = stats;
  s.storage = storage_owned ? storage_owned->stats() : storage_final;
  return s;
}


TaskRunner::TaskRunner(endpoint::RankEndpoint& endpoint, DeviceBackend& backend, AttachedCache cache)
    : impl_(std::make_unique<Impl>(endpoint, backend, std::move(cache))) {}

TaskRunner::~TaskRunner() = default;

RunnerStats TaskRunner::stats() const { return impl_->snapshot_stats(); }

std::optional<proto::TaskRecordHeader> TaskRunner::clear_task() const { return impl_->clear_task; }

TaskRunner::Exit TaskRunner::run(const std::atomic<bool>& stop, const std::atomic<bool>* clear_requested) {
  auto* impl = impl_.get();
  impl->lanes.start();
  const Exit exit = impl->dispatch_loop(stop, clear_requested);
  impl->settle_parked(exit);
  impl->shut_down();
  return exit;
}

}  // namespace kvtd::daemon
