// executor_impl.h (daemon-internal) - the storage executor's private state, shared by the files
// that each hold one phase of a storage task: storage_executor.cpp (the facade, the queues and
// their threads), stored_keys.cpp (task context: key prefix, stored names, write policy),
// agreement_phase.cpp (phase 1: check, select, ask the store, agree across ranks) and
// object_io.cpp (phase 2: objects between blocks and the store, cancel and deadline checks).
//
// Threads: one agreement thread (phase 1, ring order), io_threads workers (phase 2: loads before
// writes). Locks: `mu` (queues, task sets), `prefix_mu`, `count_mu`, `stats_mu`: each is taken
// alone, never held across I/O, a wait or another of them.
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/metrics/registry.h"

namespace kvtd::daemon {

using proto::TaskKind;
using proto::TaskStatus;

// A task through phase 1: the keys it stores or loads, their blocks, the agreed count.
struct Prepared {
  StorageWork work;
  std::int64_t start = 0;
  std::vector<std::size_t> which;   // indices into work.section.keys that take part
  std::vector<std::string> stored;  // their stored names
  std::vector<std::int32_t> ids;    // their blocks
  std::uint32_t agreed = 0;
  std::uint64_t backup_bytes = 0;   // a backup's bytes still to write, counted in backup_queued
  std::int64_t queued_ns = 0;       // when phase 1 handed it to the workers
};

// Whether a STORAGE_WRITE is a backup (write-through, selective, write-back): work the engine does
// not wait for, skipped when the store falls behind.
inline bool is_backup(const StorageWork& w) {
  return (w.header.flags & (proto::kTaskFlagPolicyBackup | proto::kTaskFlagEvictBackup)) != 0;
}

struct StorageExecutor::Impl {
  endpoint::RankEndpoint& ep;
  CopyEngine& backend;  // the tensors' bytes to and from staging
  HostPool* pool;
  StorageTargets t;
  Complete complete;
  Release release;
  std::size_t chunk_objects = 0;   // objects per worker staging slice
  std::vector<std::byte*> staging;  // one slice per worker
  std::vector<HostBuffer> staging_memory;  // owns the slices: returned when the executor ends

  // The queues and the task sets. Never held across I/O, a wait or another of these mutexes.
  Mutex mu;
  // Workers sleep on this word (spin, then futex): a condition variable's wake-up alone cost
  // tens of microseconds per task, more than a whole swap round trip.
  // One word per queue, so a new task wakes only the thread that takes it: waking the workers on
  // every agreement cost several microseconds of a 2-core round trip.
  struct Wake {
    std::atomic<std::uint32_t> word{0};
    std::atomic<std::uint32_t> waiters{0};
    void bump() { ipc::bump_and_wake(word, &waiters); }
  };
  Wake agree_wake, work_wake;
  std::deque<StorageWork> agreeing GUARDED_BY(mu);  // phase 1, ring order
  std::deque<Prepared> high GUARDED_BY(mu);         // phase 2: loads first,
  std::deque<Prepared> low GUARDED_BY(mu);          // then writes
  bool agree_done GUARDED_BY(mu) = false;           // the agreement thread has exited (after closing)
  std::unordered_set<std::uint64_t> live GUARDED_BY(mu);       // queued or running task ids
  std::unordered_set<std::uint64_t> cancelled GUARDED_BY(mu);  // subset of live
  std::unordered_set<std::uint64_t> committed GUARDED_BY(mu);  // subset of live: past their last cancel check
  bool closing GUARDED_BY(mu) = false;
  // Backpressure: the bytes of backups agreed and not yet written, and how many workers write.
  // Writes take at most write_workers of the workers, so a load always finds one (io_threads > 1).
  std::uint64_t backup_queued GUARDED_BY(mu) = 0;
  std::uint32_t writes_running GUARDED_BY(mu) = 0;
  std::int64_t agreeing_since_ns GUARDED_BY(mu) = 0;  // when phase 1 of the current task began (0: idle)
  std::uint32_t write_workers = 1;
  std::vector<std::thread> workers;
  std::thread agreement;

  Mutex prefix_mu;  // the RL key prefix cache (agreement thread; any thread)
  bool prefix_known GUARDED_BY(prefix_mu) = false;
  std::uint64_t prefix_wv GUARDED_BY(prefix_mu) = 0;
  // The last task weight version seen, for KV events: a change clears what routers know.
  std::optional<std::uint64_t> events_wv GUARDED_BY(prefix_mu);
  void note_weight_version(std::uint64_t wv);
  std::string current_prefix GUARDED_BY(prefix_mu);

  Mutex count_mu;
  std::unordered_map<std::string, std::uint32_t> uses GUARDED_BY(count_mu);  // write_through_selective

  mutable Mutex stats_mu;
  StorageStats st GUARDED_BY(stats_mu);

  Impl(endpoint::RankEndpoint& e, CopyEngine& b, HostPool* p, StorageTargets targets, Complete c, Release r)
      : ep(e), backend(b), pool(p), t(std::move(targets)), complete(std::move(c)), release(std::move(r)) {}

  // FastDeploy's RL key prefix for tasks of the engine's weight version `wv`: read from
  // version.yaml again when the version changes (the engine changes it at FastDeploy's sync
  // points only, so a version.yaml the trainer rewrites mid-serving is not picked up early).
  // An unreadable file fails the task: a guessed prefix could load KV of other weights.
  Result<std::string, config::ConfigErrc> key_prefix_for(std::uint64_t wv);

  std::string stored_key(const std::string& key, const std::string& key_prefix, std::uint64_t task_weight_version) const;

  bool is_cancelled(std::uint64_t id);

  // A task's objects move in steps of at most ~4 MiB (one object when objects are larger, and
  // at least one per I/O thread so a step keeps them busy), with a cancellation check between
  // steps: a CANCEL stops a write of thousands of small objects promptly.
  std::size_t cancel_step() const;

  // Checks for a CANCEL before a step; before the last one, also marks the task committed, so
  // a CANCEL that arrives later answers that it will not stop it (it is truthful: a task that
  // CANCEL said would stop never completes ok). True: go on.
  bool may_continue(std::uint64_t id, bool last_step);

  // Why this rank's work must stop without a completion: the engine revoked its epoch.
  bool revoked(const StorageWork& w) const { return w.epoch != ep.epoch() || !ep.granted(); }

  void count_uses(const std::vector<std::string>& keys);

  // The cause first, the store (whose name may hold a long path) last: completion messages are
  // cut at 167 characters.
  std::string unavailable(const std::string& what) const { return what + " (" + t.store_name + ")"; }

  void finish(const StorageWork& w, const proto::Outcome& o, std::int64_t start) { complete(w.header, o, start); }

  // Tells the peers this rank will not agree on `w` (they stop waiting and fail it with `why`),
  // counted by cause.
  void abort_agreement(const StorageWork& w, TaskStatus why) {
    ep.abort_agreement(w.header.seq, why);
    if (t.metrics != nullptr) t.metrics->agreement_failed(why, /*this_rank=*/true);
  }
  // Fails a task that has not agreed yet: the peers stop waiting at once.
  void fail_before_agreement(const StorageWork& w, TaskStatus s, std::int64_t start, const std::string& msg);

  // The leading stored count of `keys` on this rank, agreed across ranks. On failure the task
  // has been completed (or dropped) and nullopt is returned.
  std::optional<std::uint32_t> local_then_agree(const StorageWork& w, const std::vector<std::string>& keys,
                                                std::int64_t start) {
    auto local = t.store->exists(keys);
    if (!local.ok()) {
      const auto code = local.error().code;
      fail_before_agreement(w, code == storage::StorageErrc::kUnavailable ? TaskStatus::kStorageUnavailable
                                                                          : TaskStatus::kStorageError,
                            start, unavailable(local.error().message));
      return std::nullopt;
    }
    auto agreed = ep.agree(w.header.seq, static_cast<std::uint32_t>(*local), w.header.deadline_ns);
    if (!agreed.ok()) {
      if (revoked(w)) return std::nullopt;  // the engine failed it already
      if (t.metrics != nullptr) t.metrics->agreement_failed(agreed.error().code, /*this_rank=*/false);
      finish(w, proto::Outcome::failed(agreed.error().code, agreed.error().message), start);
      return std::nullopt;
    }
    return *agreed;
  }

  // ---- Phase 1, on the agreement thread, in ring order: checks, local count, agreement. ----

  // Which keys a write stores, by its flags and the write policy; the rest count as skipped.
  std::vector<std::size_t> selected_by_policy(const StorageWork& w);

  // Runs phase 1 of `p`. Returns true when p must go on to phase 2 (a load or a write with
  // something to move); otherwise the task has been completed (or dropped, revoked).
  bool agree_phase(Prepared& p);
  // Whether `w` may take part in the agreement: false when it was already answered, revoked, past
  // its deadline, cancelled, or there is no store (each completed here, the peers told).
  bool may_agree(const StorageWork& w, std::int64_t start);
  // After the agreement: true when `p` has objects to move in phase 2, else it is completed here
  // (a query's answer, a load with no hits, a write with everything stored already).
  bool needs_objects_moved(const Prepared& p, TaskKind kind);

  // ---- Phase 2, on a worker, by priority: move the objects. No cross-rank wait here, so the
  // priority order (which may differ between ranks) can never deadlock the agreement. ----

  // STORAGE_READ and PREFETCH: loads the agreed prefix chunk by chunk through `slice`.
  void run_load(const Prepared& p, std::byte* slice);
  // One chunk of a load: read, verified and scattered into `ids` through `slice`. The objects'
  // results, or nullopt when the chunk ended the task (completed as failed here).
  std::optional<std::vector<storage::KeyResult>> load_chunk(const Prepared& p, std::span<const std::int32_t> ids,
                                                              std::span<const std::string> keys, std::byte* slice);

  void run_write(const Prepared& p, std::byte* slice);
  // Objects [from, from + c) of write `p` into the store: straight from the blocks' pieces
  // (`in_place`) or gathered into `slice` on the store's I/O threads. False when the chunk ended
  // the task (completed as failed here).
  bool write_chunk(const Prepared& p, std::size_t from, std::size_t c, bool in_place, std::byte* slice);

  // The task's deadline, checked between chunks: past it, the task fails saying how far it got.
  bool past_deadline(const StorageWork& w, std::int64_t start, std::size_t done, std::size_t of);

  // The outcome of one chunk's put: false (the task completed as failed) unless every object
  // was written.
  bool check_put(const StorageWork& w, const storage::BatchResult& put,
                 std::size_t c, std::int64_t start);


  void forget(const StorageWork& w);

  // Why backup `w` must be skipped as phase 1 takes it (it waited past --storage-backup-max-age-ms
  // since its submit, or the backups queued for the store would pass --storage-backup-queue-mib
  // with its `bytes`), or "".
  std::string backup_skip_reason(const StorageWork& w, std::uint64_t bytes, std::int64_t now);
  // Why backup `w` must be skipped as it arrives: the agreement thread has been held past
  // --storage-backup-max-age-ms (the store is stalled), or the queue bound is passed; or "".
  std::string skip_on_arrival(const StorageWork& w, std::int64_t now) REQUIRES(mu);
  // The queue bound's reason to skip a backup of `bytes` (--storage-backup-queue-mib), or "".
  std::string over_queue_bound(std::uint64_t bytes) REQUIRES(mu);
  // Completes backup `w` as backup_skipped and counts it (`new_task`: not yet counted as a task).
  void answer_skipped(const StorageWork& w, std::int64_t start, const std::string& why, bool new_task);
  // Skips backup `w` before its agreement: the peers are told, the engine gets backup_skipped.
  void skip_before_agreement(const StorageWork& w, std::int64_t now, const std::string& why);

  // Waits on `wake` until take() (called under mu) hands something over or says to stop.
  template <typename Take>
  bool wait_for(Wake& wake, Take&& take) {
    for (;;) {
      const std::uint32_t seen = wake.word.load(std::memory_order_acquire);
      {
        MutexLock g(mu);
        if (auto r = take(); r.has_value()) return *r;
      }
      (void)ipc::wait_on_word(wake.word, seen, ipc::monotonic_now_ns() + 50'000'000, &wake.waiters, 50'000);
    }
  }

  void agreement_loop();

  void worker_loop(std::size_t index);
};

}  // namespace kvtd::daemon
