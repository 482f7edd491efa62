// runner_impl.h (daemon/serve private) - the task runner: the dispatcher over the objects it
// holds: the block tracker, the parked queue, the completion sink, the swap lanes (swap_lanes.h)
// and the storage executor. task_runner.cpp holds the facade, the dispatcher loop, decoding and
// completions; admission.cpp admits, parks and starts decoded tasks.
//
// Threads: the dispatcher (run()'s caller) reads the ring, decodes, admits and starts tasks; the
// lanes and the storage executor have their own, and report back through SwapReports and
// StorageListener. `stats_mu` (figures, the executor's ownership) is never held across a copy or
// a wait.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/task_runner.h"
#include "block_tracker.h"
#include "kvtd/daemon/completion_sink.h"
#include "parked_queue.h"
#include "swap_lanes.h"
#include "task_decoder.h"
#include "swap_outcomes.h"
#include "work.h"

namespace kvtd::daemon {

using proto::TaskKind;
using proto::TaskStatus;

// A task that moves at most this many bytes (per rank) runs on the dispatcher thread itself
// when its lane is idle: a thread hand-off costs more than such a copy, and an idle lane means
// nothing of that direction is queued ahead of it (a parked task of that direction does not
// conflict with it, or it would be parked too), so the order of conflicting work is kept.
constexpr std::uint64_t kInlineMaxBytes = 256 * 1024;

// The most tasks parked at once: past it the dispatcher waits for a release before it reads on
// (a bound on memory; the ring's own capacity then pushes back on the engine).
constexpr std::size_t kMaxParked = 4096;
// While tasks are parked the ring wait is cut to this, doubling up to kParkPollMaxNs while
// nothing is released: a parked swap waits for a release by at most that long.
constexpr std::int64_t kParkPollMinNs = 50'000, kParkPollMaxNs = 2'000'000;

struct TaskRunner::Impl final : StorageListener, SwapReports {
  endpoint::RankEndpoint& ep;
  CopyEngine& backend;  // the lanes' copies
  AttachedCache cache;
  std::vector<GroupShape> group_shapes;  // what the decoder checks ids against, per cache group

  BlockTracker tracker;  // which blocks each lane has in flight: cross-lane order
  // Tasks read but not admitted yet, and the tracker generation of their last check (dispatcher
  // thread only).
  ParkedQueue parked;
  std::uint32_t parked_checked_at = 0;
  std::int64_t park_poll_ns = kParkPollMinNs;
  CompletionSink sink;   // the one writer of completions
  SwapLanes lanes;       // the two swap lanes and their threads
  // Outcomes of swaps whose backup follows them, for the backup; and the swap (dispatcher thread
  // only) whose backup must be the next record read, or 0.
  SwapOutcomes swap_outcomes;
  std::uint64_t backup_pair_swap = 0;

  mutable Mutex stats_mu;
  RunnerStats stats GUARDED_BY(stats_mu);

  // The executor, owned under stats_mu (stats() reads it from any thread) and moved out by run();
  // `storage` is the dispatcher thread's view of it: only that thread sets or clears it.
  std::unique_ptr<StorageExecutor> storage_owned GUARDED_BY(stats_mu);
  StorageExecutor* storage = nullptr;
  std::optional<proto::TaskRecordHeader> clear_task;  // the CLEAR_CACHE that ended run() (dispatcher only)
  StorageStats storage_final GUARDED_BY(stats_mu);  // the executor's figures once it is gone

  Impl(endpoint::RankEndpoint& e, DeviceBackend& b, AttachedCache c);


  // SwapReports: the lanes' completions and figures.
  void swap_completed(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns,
                      std::uint64_t bytes) override {
    complete(h, o, start_ns, bytes);
  }
  void swap_moved(Lane lane, std::uint64_t bytes) override {
    MutexLock g(stats_mu);
    (lane == Lane::kToHost ? stats.bytes_to_host : stats.bytes_to_device) += bytes;
  }
  void swaps_dropped(std::size_t n) override {
    MutexLock g(stats_mu);
    stats.tasks_dropped += n;
  }

  // ---- task_runner.cpp ----

  // Every completion of this runner (and of its storage executor) goes through the sink; the
  // runner's own figures are counted first, so they are current once the engine has the result.
  // `bytes`: what the task moved, when its executor knows it (swaps); else blocks x bytes per block.
  void complete(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns,
                std::optional<std::uint64_t> bytes = std::nullopt);

  // Every cache.summary_period_ns while tasks complete: one info line of what happened since the
  // last one (a quiet rank logs nothing). Called from the dispatcher loop.
  void maybe_summarize(RunnerStats& last, std::int64_t& at);

  void release_storage(const StorageWork& sw);

  // StorageListener: the storage executor's completions and releases, on its threads.
  void storage_completed(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns) override {
    complete(h, o, start_ns);
  }
  void storage_released(const StorageWork& sw) override { release_storage(sw); }

  // Decodes one record (serve/task_decoder.h) and answers what the dispatcher answers itself;
  // true when `w` is a task to run.
  bool decode(const std::vector<std::byte>& rec, Work& w);

  // Keeps the outcome of a swap whose backup follows (kTaskFlagBackupPair) until that backup
  // takes it; forgets a kept one whose backup is not the record `h` read after it.
  void note_backup_pair(const proto::TaskRecordHeader& h);

  // Why swap backup `w` must not be stored (its swap did not complete ok on this rank), or "".
  // Takes the swap's kept outcome.
  std::string backup_pair_problem(const Work& w);

  // The dispatcher thread: reads the ring until stop (every task published before it was noticed
  // is still read and finished, so "submitted before SIGTERM" means "completed"; bounded by the
  // head seen at that moment, so an engine that keeps submitting cannot keep a stopping daemon
  // alive), a clear, or the end of the session.
  TaskRunner::Exit dispatch_loop(const std::atomic<bool>& stop, const std::atomic<bool>* clear_requested);

  // A re-grant, a lost session or a corrupt ring: the exit it causes, if any.
  std::optional<TaskRunner::Exit> on_ring_event(endpoint::RankEndpoint::Next next);

  // Closes the lanes (they drain their queues) and the storage executor (it finishes or fails
  // what it holds, then joins); its last figures stay readable through stats().
  void shut_down();

  RunnerStats snapshot_stats() const;

  // ---- admission.cpp ----

  // Admits a decoded task and hands it on, or parks it when it must wait (serve/parked_queue.h).
  void dispatch(Work&& w, std::int64_t now);

  // Hands an admitted task to the storage executor or its lane; a small swap runs inline when its
  // lane is idle.
  void start(Work&& w, Lane lane, std::int64_t now);

  // Starts the parked tasks that may go now; skipped while nothing was released since the last
  // look (unless `force`).
  void retry_parked(bool force = false);

  // Waits until every parked task has started: what must happen before a drain, a clear or a
  // stop. The work they wait for always ends, so this ends.
  void start_all_parked();

  // With kMaxParked tasks parked, waits for one to start before the next record is read.
  void wait_for_parking_room();

  // A stop finishes what was read, parked tasks too; on a lost session, device or ring they are
  // dropped (nothing they would do could reach the engine).
  void settle_parked(TaskRunner::Exit exit);

  // ---- the lanes, the parked tasks and the executor together ----

  // Removes every queued (not yet executing) task; they belong to a revoked epoch.
  std::size_t drop_queued();

  // Waits until every admitted task (both lanes and the storage executor) has completed or was
  // dropped: what CLEAR_CACHE waits for before the mappings close. Tasks end on their own (each
  // copy finishes, storage work is bounded by its deadline and the store's timeouts); the
  // watchdog is fed meanwhile.
  void wait_until_idle();
};

}  // namespace kvtd::daemon
