#include "kvtd/base/mutex.h"
#include "kvtd/daemon/task_runner.h"

#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "serve/completion.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/task_codec.h"
#include "kvtd/ipc/wait.h"

namespace kvtd::daemon {

using proto::TaskKind;
using proto::TaskStatus;

namespace {

constexpr std::int64_t kPollSliceNs = 50'000'000;  // how often idle threads re-check stop flags
// A task that moves at most this many bytes (per rank) runs on the dispatcher thread itself
// when its lane is idle: a thread hand-off costs more than such a copy, and an idle lane means
// nothing of that direction is queued ahead of it, so submission order is kept.
constexpr std::uint64_t kInlineMaxBytes = 256 * 1024;

constexpr int kStorageLane = 2;  // tracking index of storage tasks (run by the StorageExecutor)

struct Work {
  proto::TaskRecordHeader header{};
  std::uint32_t epoch = 0;               // the grant under which the record was read
  kernels::CopyPlan plan;
  std::vector<std::int32_t> host_ids;    // for in-flight block tracking
  std::vector<std::int32_t> device_ids;
  bool storage = false;
  StorageWork storage_work;              // when `storage`
};

TaskStatus status_of(kernels::PlanErrc e) {
  switch (e) {
    case kernels::PlanErrc::kLengthMismatch: return TaskStatus::kLengthMismatch;
    case kernels::PlanErrc::kSourceOutOfRange:
    case kernels::PlanErrc::kDestinationOutOfRange: return TaskStatus::kIdOutOfRange;
    case kernels::PlanErrc::kDuplicateDestination: return TaskStatus::kDuplicateDestination;
    case kernels::PlanErrc::kSizeOverflow: return TaskStatus::kMalformed;
  }
  return TaskStatus::kInternal;
}

}  // namespace

struct TaskRunner::Impl {
  endpoint::RankEndpoint& ep;
  DeviceBackend& backend;
  AttachedCache cache;
  std::uint64_t block_bytes_all_layers = 0;  // what one block of a task moves, every layer and tensor

  // In-flight block counts per direction, for cross-direction ordering. Lock order: a lane's mu
  // before track_mu (a lane thread records a finished task under both).
  Mutex track_mu;
  // Counts, not flags: one lane may hold many tasks on a block (32 bits: no realistic queue wraps).
  std::vector<std::uint32_t> busy_host[3] GUARDED_BY(track_mu);  // by lane: to host, to device, storage
  std::vector<std::uint32_t> busy_device[3] GUARDED_BY(track_mu);
  std::unordered_map<std::uint64_t, int> inflight_tasks GUARDED_BY(track_mu);  // task id -> lane
  std::atomic<std::uint32_t> track_word{0};
  std::atomic<std::uint32_t> track_waiters{0};

  struct Lane {
    Mutex mu ACQUIRED_BEFORE(track_mu);
    std::deque<Work> queue GUARDED_BY(mu);
    std::atomic<std::uint32_t> word{0};
    std::atomic<std::uint32_t> waiters{0};
    std::atomic<bool> closing{false};
    std::atomic<std::uint32_t> outstanding{0};  // queued or executing on the lane thread
    std::thread thread;
  } lanes[2];

  mutable Mutex stats_mu;
  RunnerStats stats GUARDED_BY(stats_mu);

  // The executor, owned under stats_mu (stats() reads it from any thread) and moved out by run();
  // `storage` is the dispatcher thread's view of it: only that thread sets or clears it.
  std::unique_ptr<StorageExecutor> storage_owned GUARDED_BY(stats_mu);
  StorageExecutor* storage = nullptr;
  std::optional<proto::TaskRecordHeader> clear_task;  // the CLEAR_CACHE that ended run() (dispatcher only)
  StorageStats storage_final GUARDED_BY(stats_mu);  // the executor's figures once it is gone

  Impl(endpoint::RankEndpoint& e, DeviceBackend& b, AttachedCache c) : ep(e), backend(b), cache(std::move(c)) {
    for (auto bytes : cache.block_bytes) block_bytes_all_layers += bytes * cache.num_layers;
    auto complete_fn = [this](const proto::TaskRecordHeader& h, TaskStatus s, std::uint64_t blocks,
                              std::uint64_t skipped, std::int64_t start, const std::string& msg) {
      complete(h, s, blocks, 0, start, msg, skipped);
    };
    auto release_fn = [this](const StorageWork& sw) { release_storage(sw); };
    auto ex = StorageExecutor::create(ep, backend, cache.pool, cache.storage, complete_fn, release_fn);
    if (!ex.ok()) {
      // Storage tasks then fail, naming why; swaps are unaffected.
      KVTD_ERROR("storage tasks disabled: {}", ex.error().message);
      StorageTargets none = cache.storage;
      none.store = nullptr;
      none.no_store_reason = "storage tasks are disabled on this rank: " + ex.error().message;
      ex = StorageExecutor::create(ep, backend, cache.pool, none, complete_fn, release_fn);
    }
    MutexLock g(stats_mu);  // no other thread yet; the locks keep the analysis whole
    if (ex.ok()) {
      storage_owned = std::move(ex).value();
      storage = storage_owned.get();
    }
    MutexLock t(track_mu);
    for (int d = 0; d < 3; ++d) {
      busy_host[d].assign(static_cast<std::size_t>(cache.host_blocks), 0);
      busy_device[d].assign(static_cast<std::size_t>(cache.device_blocks), 0);
    }
  }

  void complete(const proto::TaskRecordHeader& h, TaskStatus status, std::uint64_t blocks, std::uint32_t layers,
                std::int64_t start_ns, const std::string& message, std::uint64_t skipped = 0) {
    const proto::CompletionRecord rec = completion_record(ep.rank(), h, status, blocks, layers, start_ns, message, skipped);
    const auto kind = static_cast<TaskKind>(h.kind);
    if (status != TaskStatus::kOk) {
      std::string failed = "task " + std::to_string(h.task_id) + " (" + proto::task_kind_name(kind) +
                           ") failed: " + proto::task_status_name(status) + ": " + message;
      KVTD_WARN("{}", failed);
      if (cache.metrics) cache.metrics->note_error(std::move(failed));
    }
    // Queue wait: engine submit to the start of execution; run: start to this record (same
    // CLOCK_MONOTONIC on both sides of the session).
    const std::int64_t wait_ns = start_ns > h.submit_ns && h.submit_ns > 0 ? start_ns - h.submit_ns : 0;
    const std::int64_t run_ns = rec.end_ns > start_ns ? rec.end_ns - start_ns : 0;
    const bool moves = kind != TaskKind::kStorageQuery && kind != TaskKind::kCancel && !proto::is_cache_control_kind(kind);
    const std::uint64_t bytes = moves ? blocks * block_bytes_all_layers : 0;
    KVTD_DEBUG("task {} {} {}: {} blocks, {} bytes, queue wait {} us, run {} us", h.task_id, proto::task_kind_name(kind),
               proto::task_status_name(status), blocks, bytes, wait_ns / 1000, run_ns / 1000);
    if (cache.metrics) {
      const auto dir = kind == TaskKind::kSwapToHost     ? metrics::Direction::kToHost
                       : kind == TaskKind::kSwapToDevice ? metrics::Direction::kToDevice
                       : kind == TaskKind::kStorageWrite ? metrics::Direction::kStorageWrite
                                                         : metrics::Direction::kStorageRead;
      cache.metrics->task_done(kind, status, dir, bytes, wait_ns, run_ns);
    }
    {
      MutexLock g(stats_mu);
      if (status == TaskStatus::kOk) ++stats.tasks_ok;
      else ++stats.tasks_failed;
      stats.queue_wait_ns_max = std::max(stats.queue_wait_ns_max, wait_ns);
    }
    if (auto st = ep.complete(rec); !st.ok()) KVTD_ERROR("lost completion of task {}: {}", h.task_id, st.error().message);
  }

  // Every cache.summary_period_ns while tasks complete: one info line of what happened since the
  // last one (a quiet rank logs nothing). Called from the dispatcher loop.
  void maybe_summarize(RunnerStats& last, std::int64_t& at) {
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

  static int lane_of(TaskKind k) { return k == TaskKind::kSwapToHost ? 0 : 1; }

  // True if `w` touches a block another lane still has in flight, or names an
  // after-task still in flight there. The storage lane also waits for itself: its worker pool
  // keeps no order of its own.
  bool conflicts(const Work& w, int lane) const REQUIRES(track_mu) {
    for (int other = 0; other < 3; ++other) {
      if (other == lane && lane != kStorageLane) continue;
      if (w.header.after_task_id != 0) {
        auto it = inflight_tasks.find(w.header.after_task_id);
        if (it != inflight_tasks.end() && it->second == other) return true;
      }
      for (auto id : w.host_ids)
        if (busy_host[other][static_cast<std::size_t>(id)]) return true;
      for (auto id : w.device_ids)
        if (busy_device[other][static_cast<std::size_t>(id)]) return true;
    }
    return false;
  }

  void release_storage(const StorageWork& sw) {
    Work w;
    w.header = sw.header;
    ((sw.header.flags & proto::kTaskFlagHostBlocks) ? w.host_ids : w.device_ids) = sw.blocks;
    {
      MutexLock g(track_mu);
      track(w, kStorageLane, -1);
    }
    ipc::bump_and_wake(track_word, &track_waiters);
  }

  void track(const Work& w, int lane, int delta) REQUIRES(track_mu) {
    for (auto id : w.host_ids) busy_host[lane][static_cast<std::size_t>(id)] += static_cast<std::uint32_t>(delta);
    for (auto id : w.device_ids) busy_device[lane][static_cast<std::size_t>(id)] += static_cast<std::uint32_t>(delta);
    if (delta > 0) inflight_tasks[w.header.task_id] = lane;
    else inflight_tasks.erase(w.header.task_id);
  }

  // Decodes and validates one record; on failure sends the error completion and returns false.
  bool decode(const std::vector<std::byte>& rec, Work& w) {
    const std::int64_t now = ipc::monotonic_now_ns();
    auto decoded = ipc::decode_task_record(rec, &w.header);
    if (!decoded.ok()) {
      complete(w.header, decoded.error().code, 0, 0, now, decoded.error().message);
      return false;
    }
    const auto& h = w.header;
    const auto kind = static_cast<TaskKind>(h.kind);
    const auto src = decoded->src, dst = decoded->dst;
    if (kind == TaskKind::kClearCache) {
      clear_task = h;  // run() drains and returns kCleared
      return false;
    }
    if (kind == TaskKind::kRestoreCache) {
      // Mapped from the registry as it is now: the engine made it live before this record, and
      // this rank attached (and read it) after that.
      complete(h, TaskStatus::kOk, 0, 0, now, "already serving the restored cache");
      return false;
    }
    if (proto::is_storage_kind(kind)) return decode_storage(w, src, dst, now);
    const bool to_host = kind == TaskKind::kSwapToHost;
    auto plan = kernels::plan_copy(src, dst, to_host ? cache.device_blocks : cache.host_blocks,
                                   to_host ? cache.host_blocks : cache.device_blocks, cache.block_bytes);
    if (!plan.ok()) {
      const char* side_note = to_host ? " (source: device blocks, destination: host blocks)"
                                      : " (source: host blocks, destination: device blocks)";
      complete(h, status_of(plan.error().code), 0, 0, now, plan.error().message + side_note);
      return false;
    }
    if (h.deadline_ns != 0 && now > h.deadline_ns) {
      complete(h, TaskStatus::kDeadlineExceeded, 0, 0, now,
               "deadline passed " + std::to_string((now - h.deadline_ns) / 1000) + " us before dispatch");
      return false;
    }
    w.plan = std::move(plan).value();
    w.device_ids.assign(to_host ? src.begin() : dst.begin(), to_host ? src.end() : dst.end());
    w.host_ids.assign(to_host ? dst.begin() : src.begin(), to_host ? dst.end() : src.end());
    return true;
  }

  // A storage record: its section decoded, its blocks checked. CANCEL is answered here.
  bool decode_storage(Work& w, std::span<const std::int32_t> section, std::span<const std::int32_t> ids, std::int64_t now) {
    const auto& h = w.header;
    const auto kind = static_cast<TaskKind>(h.kind);
    auto fail = [&](TaskStatus s, const std::string& msg) {
      if (kind != TaskKind::kCancel) ep.abort_agreement(h.seq, s);
      complete(h, s, 0, 0, now, msg);
      return false;
    };
    auto sec = ipc::decode_storage_section(section, h.num_keys);
    if (!sec.ok()) return fail(sec.error().code, sec.error().message);
    if (kind == TaskKind::kCancel) {
      if (!ids.empty() || !sec->keys.empty()) return fail(TaskStatus::kMalformed, "CANCEL carries no keys or blocks");
      const bool found = storage && storage->cancel(sec->args.cancel_task_id);
      // blocks_done 1: the task was live here and will stop between objects; 0: nothing to stop.
      complete(h, TaskStatus::kOk, found ? 1 : 0, 0, now, "");
      return false;
    }
    if (kind == TaskKind::kStorageQuery) {
      if (!ids.empty()) return fail(TaskStatus::kMalformed, "STORAGE_QUERY carries keys only");
    } else if (ids.size() != sec->keys.size()) {
      return fail(TaskStatus::kLengthMismatch, std::to_string(sec->keys.size()) + " keys for " +
                                                   std::to_string(ids.size()) + " blocks");
    }
    const bool host = (h.flags & proto::kTaskFlagHostBlocks) != 0;
    if (kind == TaskKind::kPrefetch && !host) return fail(TaskStatus::kMalformed, "PREFETCH loads into host blocks only");
    const std::int64_t limit = host ? cache.host_blocks : cache.device_blocks;
    const bool loads = kind == TaskKind::kStorageRead || kind == TaskKind::kPrefetch;
    std::vector<std::uint8_t> seen(loads ? static_cast<std::size_t>(limit) : 0);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= limit)
        return fail(TaskStatus::kIdOutOfRange, std::string(host ? "host" : "device") + " block id " +
                                                   std::to_string(ids[i]) + " at position " + std::to_string(i) +
                                                   " is outside [0, " + std::to_string(limit) + ")");
      if (loads && seen[static_cast<std::size_t>(ids[i])]++)
        return fail(TaskStatus::kDuplicateDestination, "block id " + std::to_string(ids[i]) + " is loaded twice");
    }
    if (h.deadline_ns != 0 && now > h.deadline_ns)
      return fail(TaskStatus::kDeadlineExceeded,
                  "deadline passed " + std::to_string((now - h.deadline_ns) / 1000) + " us before dispatch");
    w.storage = true;
    w.storage_work.header = h;
    w.storage_work.section = std::move(sec).value();
    w.storage_work.blocks.assign(ids.begin(), ids.end());
    (host ? w.host_ids : w.device_ids).assign(ids.begin(), ids.end());
    return true;
  }

  // Waits while `w` conflicts with the other lane, then records it as in flight.
  void admit(const Work& w, int lane) {
    for (;;) {
      const std::uint32_t seen = track_word.load(std::memory_order_acquire);
      {
        MutexLock g(track_mu);
        if (!conflicts(w, lane)) {
          track(w, lane, +1);
          return;
        }
      }
      // The other lane always finishes its in-flight copies, so this wait ends; the slice only
      // bounds each sleep.
      (void)ipc::wait_on_word(track_word, seen, ipc::monotonic_now_ns() + kPollSliceNs, &track_waiters, 2'000);
    }
  }

  void enqueue(Work&& w, int lane) {
    auto& l = lanes[lane];
    l.outstanding.fetch_add(1, std::memory_order_acq_rel);
    {
      MutexLock g(l.mu);
      l.queue.push_back(std::move(w));
    }
    ipc::bump_and_wake(l.word, &l.waiters);
  }

  void execute(Work& w, int lane) {
    const auto& h = w.header;
    const std::int64_t start = ipc::monotonic_now_ns();
    if (h.deadline_ns != 0 && start > h.deadline_ns) {
      complete(h, TaskStatus::kDeadlineExceeded, 0, 0, start,
               "deadline passed " + std::to_string((start - h.deadline_ns) / 1000) + " us before execution");
      return;
    }
    const auto& targets = lane == 0 ? cache.to_host : cache.to_device;
    if (lane == 1 && cache.pool != nullptr) {
      if (auto bad = cache.pool->first_invalid(w.host_ids)) {
        complete(h, TaskStatus::kHostTierLost, 0, 0, start,
                 "host block " + std::to_string(*bad) +
                     " holds no data written in this session (the host pool was lost with a daemon restart, or the "
                     "write into it failed or never happened)");
        return;
      }
    }
    if (lane == 0 && cache.pool != nullptr) cache.pool->mark_invalid(w.host_ids);
    Status<DeviceErrc> st;
    if (h.flags & proto::kTaskFlagLayerwise) {
      ep.progress_begin(h);
      std::uint32_t queued = 0, done = 0;
      st = backend.copy_layerwise(
          Direction::kToDevice, w.plan, targets, targets.size() / cache.num_layers,
          [&](std::uint32_t layer) {
            queued = layer + 1;
            ep.progress_update(h, queued, done);  // the engine may cudaStreamWaitEvent from here
          },
          [&](std::uint32_t layer) {
            done = layer + 1;
            ep.progress_update(h, queued, done);
          });
    } else {
      st = backend.copy(lane == 0 ? Direction::kToHost : Direction::kToDevice, w.plan, targets);
    }
    if (!st.ok()) {
      complete(h, TaskStatus::kDeviceError, 0, 0, start, st.error().message);
      return;
    }
    if (lane == 0 && cache.pool != nullptr) cache.pool->mark_valid(w.host_ids);
    const std::uint64_t bytes = task_bytes(w);
    {
      MutexLock g(stats_mu);
      (lane == 0 ? stats.bytes_to_host : stats.bytes_to_device) += bytes;
    }
    complete(h, TaskStatus::kOk, static_cast<std::uint64_t>(w.plan.num_blocks), cache.num_layers, start, "");
  }

  void lane_loop(int lane) {
    start_copy_thread(lane == 0 ? "kvtd-lane0" : "kvtd-lane1", cache.numa_node);
    auto& l = lanes[lane];
    for (;;) {
      const std::uint32_t seen = l.word.load(std::memory_order_acquire);
      Work w;
      bool have = false;
      {
        MutexLock g(l.mu);
        if (!l.queue.empty()) {
          w = std::move(l.queue.front());
          l.queue.pop_front();
          have = true;
        }
      }
      if (!have) {
        if (l.closing.load(std::memory_order_acquire)) return;  // queue drained
        (void)ipc::wait_on_word(l.word, seen, ipc::monotonic_now_ns() + kPollSliceNs, &l.waiters, 20'000);
        continue;
      }
      execute_and_release(w, lane);
      l.outstanding.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void execute_and_release(Work& w, int lane) {
    // Checked right before touching memory: once the engine revoked the epoch this work was read
    // under, it has failed the task and may reuse its blocks, so the work is dropped unrun.
    if (w.epoch != ep.epoch() || !ep.granted()) {
      MutexLock g(stats_mu);
      ++stats.tasks_dropped;
    } else {
      execute(w, lane);
    }
    {
      MutexLock g(track_mu);
      track(w, lane, -1);
    }
    ipc::bump_and_wake(track_word, &track_waiters);
  }

  // Removes every queued (not yet executing) task; they belong to a revoked epoch.
  std::size_t drop_queued() {
    std::size_t n = 0;
    for (int lane = 0; lane < 2; ++lane) {
      std::deque<Work> q;
      {
        MutexLock g(lanes[lane].mu);
        q.swap(lanes[lane].queue);
      }
      for (auto& w : q) {
        {
          MutexLock g(track_mu);
          track(w, lane, -1);
        }
        lanes[lane].outstanding.fetch_sub(1, std::memory_order_acq_rel);
        ++n;
      }
    }
    if (storage) n += storage->drop_queued();
    if (n != 0) {
      ipc::bump_and_wake(track_word, &track_waiters);
      MutexLock g(stats_mu);
      stats.tasks_dropped += n;
    }
    return n;
  }

  // Waits until every admitted task (both lanes and the storage executor) has completed or was
  // dropped: what CLEAR_CACHE waits for before the mappings close. Tasks end on their own (each
  // copy finishes, storage work is bounded by its deadline and the store's timeouts); the
  // watchdog is fed meanwhile.
  void wait_until_idle() {
    for (;;) {
      const std::uint32_t seen = track_word.load(std::memory_order_acquire);
      {
        MutexLock g(track_mu);
        if (inflight_tasks.empty()) return;
      }
      notify_watchdog();
      // Every release bumps track_word (acquire/release on it publishes the erased entry).
      (void)ipc::wait_on_word(track_word, seen, ipc::monotonic_now_ns() + kPollSliceNs, &track_waiters, 2'000);
    }
  }

  std::uint64_t task_bytes(const Work& w) const {
    return block_bytes_all_layers * static_cast<std::uint64_t>(w.plan.num_blocks);
  }
};

TaskRunner::TaskRunner(endpoint::RankEndpoint& endpoint, DeviceBackend& backend, AttachedCache cache)
    : impl_(std::make_unique<Impl>(endpoint, backend, std::move(cache))) {}

TaskRunner::~TaskRunner() = default;

RunnerStats TaskRunner::stats() const {
  RunnerStats s;
  MutexLock g(impl_->stats_mu);
  s = impl_->stats;
  s.storage = impl_->storage_owned ? impl_->storage_owned->stats() : impl_->storage_final;
  return s;
}

std::optional<proto::TaskRecordHeader> TaskRunner::clear_task() const { return impl_->clear_task; }

TaskRunner::Exit TaskRunner::run(const std::atomic<bool>& stop, const std::atomic<bool>* clear_requested) {
  auto* impl = impl_.get();
  for (int d = 0; d < 2; ++d) impl->lanes[d].thread = std::thread([impl, d] { impl->lane_loop(d); });

  Exit exit = Exit::kStopped;
  std::vector<std::byte> record;
  record.reserve(4096);
  // On stop, every task published before the stop was noticed is still read and finished, so
  // "submitted before SIGTERM" means "completed"; what arrives later is failed by the engine when
  // this epoch says it is leaving. Bounded by the head seen at that moment: an engine that keeps
  // submitting cannot keep a stopping daemon alive.
  std::optional<std::uint64_t> drain_until;
  RunnerStats last_summary = stats();
  std::int64_t summary_at = ipc::monotonic_now_ns();
  for (;;) {
    notify_watchdog();
    if (impl->backend.broken()) {
      // The device context is gone: nothing enqueued from now on would run. Stop reading; the
      // engine fails what is left in the ring when this epoch leaves.
      exit = Exit::kDeviceLost;
      break;
    }
    impl->maybe_summarize(last_summary, summary_at);
    if (impl->cache.metrics) impl->cache.metrics->set_ring_depth(impl->ep.ring_published() - impl->ep.ring_read());
    const bool stopping = stop.load(std::memory_order_acquire);
    if (!stopping && clear_requested != nullptr && clear_requested->load(std::memory_order_acquire)) {
      impl->wait_until_idle();
      exit = Exit::kCleared;
      break;
    }
    if (stopping && !drain_until) drain_until = impl->ep.ring_published();
    if (drain_until && impl->ep.ring_read() >= *drain_until) break;
    const std::int64_t now = ipc::monotonic_now_ns();
    const auto next = impl->ep.next_task(record, stopping ? now : now + kPollSliceNs);
    if (next == endpoint::RankEndpoint::Next::kTimeout) {
      if (stopping) break;
      continue;
    }
    if (next == endpoint::RankEndpoint::Next::kRegranted) {
      const std::size_t dropped = impl->drop_queued();
      KVTD_WARN("the engine had counted this rank as dead and failed its tasks; dropped {} queued tasks of the "
                "revoked epoch unrun; re-attached as epoch {}",
                dropped, impl->ep.epoch());
      if (!impl->ep.cache_live()) {
        // The engine cleared its cache meanwhile (this rank's CLEAR_CACHE was failed for it):
        // release the mappings before anything else.
        impl->wait_until_idle();
        exit = Exit::kCleared;
        break;
      }
      continue;
    }
    if (next == endpoint::RankEndpoint::Next::kLost) {
      exit = Exit::kSessionLost;
      break;
    }
    if (next == endpoint::RankEndpoint::Next::kCorrupt) {
      exit = Exit::kRingCorrupt;
      break;
    }
    Work w;
    w.epoch = impl->ep.epoch();
    if (!impl->decode(record, w)) {
      if (impl->clear_task) {  // CLEAR_CACHE: everything before it finishes first
        impl->wait_until_idle();
        exit = Exit::kCleared;
        break;
      }
      continue;
    }
    if (w.storage) {
      w.storage_work.epoch = w.epoch;
      impl->admit(w, kStorageLane);
      if (impl->storage) {
        impl->storage->submit(std::move(w.storage_work));
      } else {
        impl->ep.abort_agreement(w.header.seq);
        impl->ep.leave_agreements(w.header.seq + 1);  // no executor: nothing else agrees here
        impl->complete(w.header, TaskStatus::kInternal, 0, 0, now, "storage executor could not start");
        impl->release_storage(w.storage_work);
      }
      continue;
    }
    const int lane = Impl::lane_of(static_cast<TaskKind>(w.header.kind));
    impl->admit(w, lane);
    const bool layerwise = (w.header.flags & proto::kTaskFlagLayerwise) != 0;
    if (!layerwise && impl->lanes[lane].outstanding.load(std::memory_order_acquire) == 0 &&
        impl->task_bytes(w) <= kInlineMaxBytes) {
      impl->execute_and_release(w, lane);
    } else {
      impl->enqueue(std::move(w), lane);
    }
  }

  for (auto& l : impl->lanes) {
    l.closing.store(true, std::memory_order_release);
    ipc::bump_and_wake(l.word, &l.waiters);
  }
  for (auto& l : impl->lanes)
    if (l.thread.joinable()) l.thread.join();
  // The executor finishes what it holds (or fails it, if the session is gone) and joins; its last
  // figures stay readable through stats().
  std::unique_ptr<StorageExecutor> executor;
  {
    MutexLock g(impl->stats_mu);
    executor = std::move(impl->storage_owned);
    impl->storage = nullptr;
  }
  if (executor) {
    executor->close();
    MutexLock g(impl->stats_mu);
    impl->storage_final = executor->stats();
  }
  return exit;
}

}  // namespace kvtd::daemon
