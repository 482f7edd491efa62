// kvtd/daemon/task_runner.h - serves one attached session: a dispatcher thread reads the task
// ring, validates and plans each task, and hands it to the executor of its direction (one for
// device->host, one for host->device), so an eviction never waits behind a load.
//
// Storage tasks go to a StorageExecutor (its own worker pool, see storage_executor.h); CANCEL
// is answered by the dispatcher.
//
// Ordering: tasks of one direction run in submission order. A task that touches a host or
// device block that a task of another lane still has in flight (or that names such a task in
// after_task_id) waits for it, so an evict followed by a load of the same block sees the evicted
// bytes; storage tasks also wait for earlier storage tasks on the same blocks (their pool runs
// them in any order otherwise). Independent tasks run concurrently.
//
// Every task gets exactly one completion: ok, or an error naming the problem. A malformed task
// never stops the runner. Exception: work read under an epoch the engine has since revoked is
// dropped without a completion and without touching memory: the engine already failed it and
// may have reused its blocks.
//
// Host blocks: a SWAP_TO_HOST marks its destination blocks invalid before copying and valid
// after; a SWAP_TO_DEVICE whose source holds an invalid block fails with kHostTierLost.
//
// Logging: one debug line per task (kind, status, blocks, bytes, queue wait, run time); an info
// line every summary period while tasks complete.
//
// Ownership: borrows the endpoint and backend, which must outlive it. Not copyable.
// Thread-safety: run() once, from one thread; stats() from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kvtd/daemon/attached_cache.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/endpoint/rank_endpoint.h"

namespace kvtd::daemon {

struct RunnerStats {
  std::uint64_t tasks_ok = 0;
  std::uint64_t tasks_failed = 0;
  std::uint64_t tasks_dropped = 0;  // read under a revoked epoch: neither run nor reported
  std::uint64_t bytes_to_host = 0;
  std::uint64_t bytes_to_device = 0;
  std::int64_t queue_wait_ns_max = 0;  // longest submit-to-start wait since the last summary
  StorageStats storage;
};

class TaskRunner {
 public:
  // kCleared: a CLEAR_CACHE record (clear_task()), an operator's clear, or a re-grant that found
  // the cache cleared; every task read before it has completed. The caller closes the mappings
  // and completes the CLEAR_CACHE.
  // kDeviceLost: the backend is broken() (a sticky device error); the task that met it failed.
  enum class Exit { kStopped, kSessionLost, kRingCorrupt, kCleared, kDeviceLost };

  TaskRunner(endpoint::RankEndpoint& endpoint, DeviceBackend& backend, AttachedCache cache);
  ~TaskRunner();
  TaskRunner(const TaskRunner&) = delete;
  TaskRunner& operator=(const TaskRunner&) = delete;

  // Serves until `stop` is set (every task already in the ring then is still read and finished),
  // the session is lost, or the cache is cleared (also when *clear_requested turns true).
  // Returns why it stopped. RESTORE_CACHE while serving is answered ok (the mapping is current).
  Exit run(const std::atomic<bool>& stop, const std::atomic<bool>* clear_requested = nullptr);
  // The CLEAR_CACHE record that ended run() with kCleared, if one did.
  std::optional<proto::TaskRecordHeader> clear_task() const;

  RunnerStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtd::daemon
