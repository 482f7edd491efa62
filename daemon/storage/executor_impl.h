// executor_impl.h (daemon/storage private) - the storage executor: its threads and phase 1, over
// objects that own their state: the queues and task sets (task_queues.h), the stored names
// (stored_names.h), the write policy (write_policy.h) and the object mover (object_mover.h).
//
// Threads: one agreement thread (phase 1, ring order: agreement_phase.cpp), io_threads workers
// (phase 2, loads before writes: the mover). Every completion and release goes to the listener.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/metrics/registry.h"
#include "object_mover.h"
#include "stored_names.h"
#include "task_queues.h"
#include "write_policy.h"

namespace kvtd::daemon {

using proto::TaskKind;
using proto::TaskStatus;

struct StorageExecutor::Impl {
  Impl(endpoint::RankEndpoint& e, CopyEngine& copies, HostPool* pool, StorageTargets targets, StorageListener& l,
       std::size_t chunk_objects, TaskQueues::Limits limits)
      : ep(e),
        t(std::move(targets)),
        listener(l),
        queues(limits),
        names(t.config, t.slicing, e.rank(), t.kv_events),
        policy(t.config),
        mover(t, copies, pool, queues, e, chunk_objects) {}

  endpoint::RankEndpoint& ep;
  const StorageTargets t;
  StorageListener& listener;
  TaskQueues queues;
  StoredNames names;
  WritePolicy policy;
  ObjectMover mover;
  std::vector<std::byte*> staging;         // one slice per worker
  std::vector<HostBuffer> staging_memory;  // owns the slices: returned when the executor ends
  std::vector<std::thread> workers;
  std::thread agreement;

  mutable Mutex stats_mu;
  std::uint64_t tasks GUARDED_BY(stats_mu) = 0;
  std::uint64_t backups_skipped GUARDED_BY(stats_mu) = 0;

  // Reports `o` for `w`; a backup skipped is counted (`new_task`: not yet counted as a task).
  void finish(const StorageWork& w, const proto::Outcome& o, std::int64_t start, bool new_task = false);
  // Done with `w`, completed or dropped: no longer live, its blocks released.
  void forget(const StorageWork& w) {
    queues.forget(w.header.task_id);
    listener.storage_released(w);
  }
  bool revoked(const StorageWork& w) const { return mover.revoked(w); }
  // The cause first, the store (whose name may hold a long path) last: completion messages are
  // cut at 167 characters.
  std::string unavailable(const std::string& what) const { return what + " (" + t.store_name + ")"; }

  // ---- Phase 1, on the agreement thread, in ring order (agreement_phase.cpp) ----

  // Runs phase 1 of `p`. True when p must go on to phase 2 (a load or a write with something to
  // move); otherwise the task has been completed (or dropped, revoked).
  bool agree_phase(Prepared& p);
  // Whether `w` may take part in the agreement: false when it was already answered, revoked, past
  // its deadline, cancelled, or there is no store (each completed here, the peers told).
  bool may_agree(const StorageWork& w, std::int64_t start);
  // The leading keys whose every part (`parts` consecutive objects of `objects`) is stored on
  // this rank, agreed across ranks (MIN). On failure the task has been completed (or dropped)
  // and nullopt is returned.
  std::optional<std::uint32_t> local_then_agree(const StorageWork& w, const std::vector<std::string>& objects,
                                                std::uint32_t parts, std::int64_t start);
  // This rank's `local` count agreed across ranks (MIN); nullopt (completed or dropped) on failure.
  std::optional<std::uint32_t> agree_on(const StorageWork& w, std::uint32_t local, std::int64_t start);
  // Phase 1 of a group session's task (group_agreement.cpp): each (key, group) object asked of
  // its group's store, the loadable prefix by the groups' rules (or, for a write, the leading keys
  // stored whole) agreed across ranks, then the units phase 2 moves: a load only the pages each
  // group's rule needs at the agreed point; a write every group's block of the keys after it.
  bool agree_groups(Prepared& p, std::vector<std::size_t> which, const std::string& key_prefix);
  // Which of a group task's objects this rank's stores hold (here[g][i], names in group_names):
  // every key for a query, else only those the task names a block for (a key without one is
  // neither loaded nor written). False when a store failed: the task is completed.
  bool group_presence(const Prepared& p, const std::string& key_prefix,
                      std::vector<std::vector<std::string>>& group_names, std::vector<std::vector<bool>>& here);
  // Per group, whether it takes part in `n`-key task of `kind` (group_agreement.cpp says which).
  template <typename Block>
  std::vector<bool> taking_part(TaskKind kind, std::uint32_t n, Block& block) const;
  template <typename Present, typename Block>
  std::uint32_t local_answer(TaskKind kind, std::uint32_t n, Present& present, Block& block,
                             const std::vector<std::vector<bool>>& here) const;
  // After the agreement: true when `p` has objects to move in phase 2, else it is completed here
  // (a query's answer, a load with no hits, a write with everything stored already).
  bool needs_objects_moved(const Prepared& p, TaskKind kind);
  // Tells the peers this rank will not agree on `w` (they stop waiting and fail it with `why`),
  // counted by cause.
  void abort_agreement(const StorageWork& w, TaskStatus why);
  // Fails a task that has not agreed yet: the peers stop waiting at once.
  void fail_before_agreement(const StorageWork& w, TaskStatus s, std::int64_t start, const std::string& msg);
  // Why backup `w` must be skipped as phase 1 takes it (it waited past --storage-backup-max-age-ms
  // since its submit, or the backups queued would pass --storage-backup-queue-mib), or "".
  std::string backup_skip_reason(const StorageWork& w, std::int64_t now);
  // Skips backup `w` before its agreement: the peers are told, the engine gets backup_skipped.
  void skip_before_agreement(const StorageWork& w, std::int64_t now, const std::string& why);

  void agreement_loop();
  // ---- Phase 2, on a worker, by priority: the mover moves the objects. No cross-rank wait
  // here, so the priority order (which may differ between ranks) can never deadlock phase 1. ----
  void worker_loop(std::size_t index);
};

}  // namespace kvtd::daemon
