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

#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/metrics/registry.h"

namespace kvtd::daemon {

// One cache group's copy targets: a single-shape geometry is one group of every layer; a session
// with cache groups has one per group (kvtd/proto/group_slots.h).
struct GroupCache {
  std::vector<kernels::CopyTarget> to_host;    // each of its layers x tensors: device -> host
  std::vector<kernels::CopyTarget> to_device;  // the same pairs reversed
  std::vector<std::uint64_t> block_bytes;      // per tensor of a layer
  std::int64_t device_blocks = 0;              // ids a swap may use: valid in every layer
  std::int64_t host_blocks = 0;
  std::int64_t device_base = 0;                // its first id in a task's device (host) id space
  std::int64_t host_base = 0;
  std::uint32_t num_layers = 0;
  std::vector<std::uint32_t> layers;  // the session's layer of each of its layers, ascending
  HostPool* pool = nullptr;  // validity of its host blocks; borrowed, outlives the runner
};

// The copy targets of one attached cache, built once per attach.
struct AttachedCache {
  std::vector<GroupCache> groups;  // at least one
  bool group_session = false;      // the session declared cache groups
  std::int64_t device_blocks = 0;  // every group's ids: the task's id space
  std::int64_t host_blocks = 0;
  int numa_node = -1;        // the swap lanes run on this node's CPUs (-1: anywhere)
  std::int64_t summary_period_ns = 60'000'000'000;  // info summary while busy; 0 = none
  // Longest a swap waits for its engine event while the engine lives (0: only liveness and the
  // task's deadline bound it); past it the task fails with engine_event_not_fired.
  std::int64_t engine_event_timeout_ns = 60'000'000'000;
  config::VerifySwaps verify_swaps = config::VerifySwaps::kSampled;  // --verify-swaps
  metrics::MetricsRegistry* metrics = nullptr;      // borrowed; null: no metrics
  std::int64_t granted_ns = 0;  // monotonic time the session was granted (0: unknown), for the log
  StorageTargets storage;    // storage tasks (store null: they fail with storage_unavailable)
};

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
