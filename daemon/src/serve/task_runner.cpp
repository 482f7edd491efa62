#include "kvtd/base/mutex.h"
#include "kvtd/daemon/task_runner.h"

#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "serve/block_tracker.h"
#include "serve/completion_sink.h"
#include "serve/task_decoder.h"
#include "serve/work.h"
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

constexpr int kStorageLane = BlockTracker::kStorageLane;  // storage tasks (run by the StorageExecutor)

// What the block tracker sees of a task: its blocks, and on which side it only reads them (a
// swap reads its source side; a STORAGE_WRITE reads its blocks; loads write theirs).
TrackedTask tracked(const Work& w) {
  const auto kind = static_cast<TaskKind>(w.header.kind);
  TrackedTask t{w.header.task_id, w.header.after_task_id, w.host_ids, w.device_ids};
  t.reads_device = kind == TaskKind::kSwapToHost || kind == TaskKind::kStorageWrite;
  t.reads_host = kind == TaskKind::kSwapToDevice || kind == TaskKind::kStorageWrite;
  return t;
}

}  // namespace

struct TaskRunner::Impl {
  endpoint::RankEndpoint& ep;
  CopyEngine& backend;  // the lanes' copies
  AttachedCache cache;
  std::uint64_t block_bytes_all_layers = 0;  // what one block of a task moves, every layer and tensor

  BlockTracker tracker;  // which blocks each lane has in flight: cross-lane order
  CompletionSink sink;   // the one writer of completions

  struct Lane {
    Mutex mu;
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

  Impl(endpoint::RankEndpoint& e, DeviceBackend& b, AttachedCache c)
      : ep(e),
        backend(b),
        cache(std::move(c)),
        tracker(cache.host_blocks, cache.device_blocks),
        sink(ep, cache.metrics) {
    for (auto bytes : cache.block_bytes) block_bytes_all_layers += bytes * cache.num_layers;
    auto complete_fn = [this](const proto::TaskRecordHeader& h, TaskStatus s, std::uint64_t blocks,
                              std::uint64_t skipped, std::int64_t start, const std::string& msg) {
      complete(h, s, blocks, 0, start, msg, skipped);
    };
    auto release_fn = [this](const StorageWork& sw) { release_storage(sw); };
    auto ex = StorageExecutor::create(ep, b, b, cache.pool, cache.storage, complete_fn, release_fn);
    if (!ex.ok()) {
      // Storage tasks then fail, naming why; swaps are unaffected.
      KVTD_ERROR("storage tasks disabled: {}", ex.error().message);
      StorageTargets none = cache.storage;
      none.store = nullptr;
      none.no_store_reason = "storage tasks are disabled on this rank: " + ex.error().message;
      ex = StorageExecutor::create(ep, b, b, cache.pool, none, complete_fn, release_fn);
    }
    MutexLock g(stats_mu);  // no other thread yet; the locks keep the analysis whole
    if (ex.ok()) {
      storage_owned = std::move(ex).value();
      storage = storage_owned.get();
    }
  }

  // Every completion of this runner (and of its storage executor) goes through the sink; the
  // runner's own figures are counted first, so they are current once the engine has the result.
  void complete(const proto::TaskRecordHeader& h, TaskStatus status, std::uint64_t blocks, std::uint32_t layers,
                std::int64_t start_ns, const std::string& message, std::uint64_t skipped = 0) {
    const auto kind = static_cast<TaskKind>(h.kind);
    const bool moves = kind != TaskKind::kStorageQuery && kind != TaskKind::kCancel && !proto::is_cache_control_kind(kind);
    {
      MutexLock g(stats_mu);
      if (status == TaskStatus::kOk) ++stats.tasks_ok;
      else ++stats.tasks_failed;
      stats.queue_wait_ns_max = std::max(stats.queue_wait_ns_max, CompletionSink::queue_wait_ns(h, start_ns));
    }
    sink.report(h, status, blocks, layers, start_ns, message, moves ? blocks * block_bytes_all_layers : 0, skipped);
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

  void release_storage(const StorageWork& sw) {
    Work w;
    w.header = sw.header;
    ((sw.header.flags & proto::kTaskFlagHostBlocks) ? w.host_ids : w.device_ids) = sw.blocks;
    tracker.release(tracked(w), kStorageLane);
  }

  // Decodes one record (serve/task_decoder.h) and answers what the dispatcher answers itself;
  // true when `w` is a task to run.
  bool decode(const std::vector<std::byte>& rec, Work& w) {
    const std::int64_t now = ipc::monotonic_now_ns();
    auto d = decode_record(rec, CacheShape{cache.device_blocks, cache.host_blocks, cache.block_bytes}, now);
    const std::uint32_t epoch = w.epoch;  // the grant it was read under: not the decoder's to know
    w = std::move(d.work);
    w.epoch = epoch;
    const auto& h = w.header;
    switch (d.action) {
      case DecodedRecord::Action::kRun: return true;
      case DecodedRecord::Action::kClear: clear_task = h; return false;  // run() drains and returns kCleared
      case DecodedRecord::Action::kRestore:
        // Mapped from the registry as it is now: the engine made it live before this record, and
        // this rank attached (and read it) after that.
        complete(h, TaskStatus::kOk, 0, 0, now, "already serving the restored cache");
        return false;
      case DecodedRecord::Action::kCancel: {
        const bool found = storage && storage->cancel(d.cancel_task_id);
        // blocks_done 1: the task was live here and will stop between objects; 0: nothing to stop.
        complete(h, TaskStatus::kOk, found ? 1 : 0, 0, now, "");
        return false;
      }
      case DecodedRecord::Action::kFail: break;
    }
    if (d.abort_agreement) ep.abort_agreement(h.seq, d.status);
    complete(h, d.status, 0, 0, now, d.message);
    return false;
  }

  // Waits while `w` conflicts with another lane's work, then records it as in flight.
  void admit(const Work& w, int lane) { tracker.admit(tracked(w), lane, kPollSliceNs); }

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
    tracker.release(tracked(w), lane);
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
        tracker.release(tracked(w), lane);
        lanes[lane].outstanding.fetch_sub(1, std::memory_order_acq_rel);
        ++n;
      }
    }
    if (storage) n += storage->drop_queued();
    if (n != 0) {
      MutexLock g(stats_mu);
      stats.tasks_dropped += n;
    }
    return n;
  }

  // Waits until every admitted task (both lanes and the storage executor) has completed or was
  // dropped: what CLEAR_CACHE waits for before the mappings close. Tasks end on their own (each
  // copy finishes, storage work is bounded by its deadline and the store's timeouts); the
  // watchdog is fed meanwhile.
  void wait_until_idle() { tracker.wait_until_idle(kPollSliceNs, [] { notify_watchdog(); }); }

  std::uint64_t task_bytes(const Work& w) const {
    return block_bytes_all_layers * static_cast<std::uint64_t>(w.plan.num_blocks);
  }

  // The dispatcher thread: reads the ring until stop (every task published before it was noticed
  // is still read and finished, so "submitted before SIGTERM" means "completed"; bounded by the
  // head seen at that moment, so an engine that keeps submitting cannot keep a stopping daemon
  // alive), a clear, or the end of the session.
  TaskRunner::Exit dispatch_loop(const std::atomic<bool>& stop, const std::atomic<bool>* clear_requested) {
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
      const std::int64_t now = ipc::monotonic_now_ns();
      const auto next = ep.next_task(record, stopping ? now : now + kPollSliceNs);
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

  // A re-grant, a lost session or a corrupt ring: the exit it causes, if any.
  std::optional<TaskRunner::Exit> on_ring_event(endpoint::RankEndpoint::Next next) {
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

  // Hands a decoded task to its lane (small swaps run inline when their lane is idle) or to the
  // storage executor, once the block tracker admits it.
  void dispatch(Work&& w, std::int64_t now) {
    if (w.storage) {
      w.storage_work.epoch = w.epoch;
      admit(w, kStorageLane);
      if (storage) {
        storage->submit(std::move(w.storage_work));
      } else {
        ep.abort_agreement(w.header.seq);
        ep.leave_agreements(w.header.seq + 1);  // no executor: nothing else agrees here
        complete(w.header, TaskStatus::kInternal, 0, 0, now, "storage executor could not start");
        release_storage(w.storage_work);
      }
      return;
    }
    const int lane = lane_of(static_cast<TaskKind>(w.header.kind));
    admit(w, lane);
    const bool layerwise = (w.header.flags & proto::kTaskFlagLayerwise) != 0;
    if (!layerwise && lanes[lane].outstanding.load(std::memory_order_acquire) == 0 &&
        task_bytes(w) <= kInlineMaxBytes) {
      execute_and_release(w, lane);
    } else {
      enqueue(std::move(w), lane);
    }
  }

  // Closes the lanes (they drain their queues) and the storage executor (it finishes or fails
  // what it holds, then joins); its last figures stay readable through stats().
  void shut_down() {
    for (auto& l : lanes) {
      l.closing.store(true, std::memory_order_release);
      ipc::bump_and_wake(l.word, &l.waiters);
    }
    for (auto& l : lanes)
      if (l.thread.joinable()) l.thread.join();
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

  RunnerStats snapshot_stats() const {
    MutexLock g(stats_mu);
    RunnerStats s = stats;
    s.storage = storage_owned ? storage_owned->stats() : storage_final;
    return s;
  }
};

TaskRunner::TaskRunner(endpoint::RankEndpoint& endpoint, DeviceBackend& backend, AttachedCache cache)
    : impl_(std::make_unique<Impl>(endpoint, backend, std::move(cache))) {}

TaskRunner::~TaskRunner() = default;

RunnerStats TaskRunner::stats() const { return impl_->snapshot_stats(); }

std::optional<proto::TaskRecordHeader> TaskRunner::clear_task() const { return impl_->clear_task; }

TaskRunner::Exit TaskRunner::run(const std::atomic<bool>& stop, const std::atomic<bool>* clear_requested) {
  auto* impl = impl_.get();
  for (int d = 0; d < 2; ++d) impl->lanes[d].thread = std::thread([impl, d] { impl->lane_loop(d); });
  const Exit exit = impl->dispatch_loop(stop, clear_requested);
  impl->shut_down();
  return exit;
}

}  // namespace kvtd::daemon
