// kvtd/daemon/storage_executor.h - runs a rank's storage tasks (STORAGE_QUERY, STORAGE_READ,
// STORAGE_WRITE, PREFETCH) on threads of its own, never on the swap lanes.
//
// Phase 1, on one agreement thread in ring order: the checks (epoch, deadline, cancel, store),
// the write policy's selection, the rank's leading stored count, and the agreement on the MIN
// across ranks (RankEndpoint::agree: bounded, fails when a peer dies). Ring order on every rank
// means every rank waits on the same task at the same point, so no two tasks can deadlock.
// Phase 2, on `--storage-io-threads` workers, reads and prefetches before writes: the agreed
// prefix is loaded, or the rest written, chunk by chunk through the worker's slice of a bounded
// pinned staging buffer, so memory is bounded whatever the task size. The layout transform runs
// per object on the store's I/O thread that moves it; blocks the CPU can read in place are
// written without staging (file store). A chunk whose objects are missing or corrupt on this
// rank ends the load there (the engine's merge takes the MIN over ranks); one the store failed
// to read ends it with storage_unavailable (the blocks before it loaded). A CANCEL or the
// deadline stops a task between steps of at most ~4 MiB; a CANCEL that arrives once the last
// step began answers that it will not stop the task.
//
// Stored key: "<engine key>.w<deployment weight version>-<task weight version>.r<rank>" in the
// store's namespace (model id + layout fingerprint), so KV from other weights, another layout or
// another rank's slice is never loaded. MLA (no value cache, replicated): every rank reads
// rank 0's objects and only rank 0 writes.
//
// Ownership: borrows the endpoint, backend, pool and store, which must outlive it; owns its
// threads and staging. Not copyable. Thread-safety: submit/cancel/drop_queued from the
// dispatcher thread; stats() from any thread; the destructor finishes queued work and joins.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/ipc/task_codec.h"
#include "kvtd/kernels/layout.h"
#include "kvtd/proto/cache_groups.h"
#include "kvtd/proto/outcome.h"
#include "kvtd/proto/task.h"

namespace kvtd::storage {
class ObjectStore;
}

namespace kvtd::events {
class KvEventPublisher;
}
namespace kvtd::metrics {
class MetricsRegistry;
}

namespace kvtd::daemon {

// The layout fingerprint of a geometry's stored objects as `slicing` cuts them: what shapes an
// object's bytes (dtype, heads, block size, head dim, layers, which tensors exist; not the block
// counts). The TP size is in it only where the bytes depend on it: objects by rank of a cache
// split by head. Objects by head carry the model's heads and the heads per object instead, and a
// replicated (MLA) cache neither, so every TP size finds the same namespace. `id`: the KV's
// declared dtype, pipeline stage and context-parallel slice (kvtd/proto/kv_identity.h), each
// in it when declared (nothing declared: the fingerprint of a geometry as before identities).
std::uint64_t layout_fingerprint(const proto::CacheGeometry& g, const proto::ObjectSlicing& slicing,
                                 const proto::KvIdentity& id);

// The layout fingerprint of cache group `g`'s stored objects (each group of a session is a
// namespace of its own, its objects one block of every layer and tensor of the group): its kind,
// tensors, layers, tokens per block and window, and the TP size unless the group is replicated
// (proto::group_replicated: an MLA latent, an indexer beside it; every TP size reads rank 0's
// objects), and `id` as in layout_fingerprint. Not the block counts. `gs` passed geometry_problem.
std::uint64_t group_fingerprint(const proto::CacheGroups& gs, std::uint32_t g, const proto::KvIdentity& id);

// The storage workers to run: --storage-io-threads when given; otherwise half of `cpus`, 2 to 8
// (reads and hashing are CPU-bound, a store's latency wants several in flight), lowered until each
// worker's slice of the staging holds one object of `object_bytes`.
std::uint32_t storage_io_threads(const config::StorageConfig& c, std::uint64_t object_bytes, unsigned cpus);

// "" when --storage-staging-mib over --storage-io-threads gives each worker room for at least
// one object of `object_bytes`, else the problem in words (start-up refuses it with exit 2).
std::string staging_problem(const config::StorageConfig& c, std::uint64_t object_bytes);

// One cache group's share of a group session's storage: a namespace of its own
// (group_fingerprint) whose objects are one block of the group, every layer and tensor.
struct GroupStorage {
  storage::ObjectStore* store = nullptr;  // the group's namespace; borrowed, outlives the executor
  std::vector<kernels::LayerTensor> device_tensors;  // the group's layers x tensors, layer-major
  std::vector<kernels::LayerTensor> host_tensors;    // its host pool's regions, same order
  std::uint64_t object_bytes = 0;
  std::int64_t device_base = 0, host_base = 0;  // its first id in a task's device (host) id space
  HostPool* pool = nullptr;        // validity of its host blocks; borrowed
  std::uint32_t trailing = 0;      // pages before a prefix's end it needs; 0: every page (group_hits.h)
  bool replicated = false;         // stored once by rank 0 under rank 0's name, read by every rank
};

// What the executor needs from the attached cache.
struct StorageTargets {
  storage::ObjectStore* store = nullptr;  // null: storage tasks fail with no_store_reason
  std::string no_store_reason = "no storage backend is configured on this rank (--storage-backend none)";
  std::string store_name;                 // for messages: "file store /path", "redis host:port"
  config::StorageConfig config;
  std::vector<kernels::LayerTensor> device_tensors;  // layer-major, present kinds
  std::vector<kernels::LayerTensor> host_tensors;    // the host pool's regions, same order
  // How a block is cut into objects (kvtd/proto/object_slices.h): `slicing.parts` objects per
  // key, each holding the same share of every tensor's block (a run of heads), `object_bytes`
  // each. Default: one object of the whole block, by rank.
  proto::ObjectSlicing slicing;
  std::uint64_t object_bytes = 0;
  // The bytes a worker's staging slice must hold at least: a key's objects, or a group session's
  // largest object (phase 2 moves one group's objects at a time).
  std::uint64_t staged_bytes() const { return groups.empty() ? key_bytes() : object_bytes; }
  // Bytes one key moves on this rank: every part of its block (a group session: every group's).
  std::uint64_t key_bytes() const {
    if (groups.empty()) return object_bytes * slicing.parts;
    std::uint64_t sum = 0;
    for (const auto& g : groups) sum += g.object_bytes;
    return sum;
  }
  // A session of cache groups (`groups` one per group of `layout`, `object_bytes` the largest
  // group object, `store` group 0's): a task names each key's block per group and each group's
  // rule says what a prefix needs (kvtd/proto/group_hits.h). Empty: a single-shape session.
  proto::CacheGroups layout{};
  std::vector<GroupStorage> groups;
  int numa_node = -1;                     // the I/O workers run on this node's CPUs (-1: anywhere)
  // Rank 0 with --kv-events-endpoint: told of every object it stores and of weight-version
  // changes (not owned; outlives the executor). Null elsewhere.
  events::KvEventPublisher* kv_events = nullptr;
  // Agreed lookups and failed agreements are counted here (not owned; null: not counted).
  metrics::MetricsRegistry* metrics = nullptr;
};

// One decoded storage task, validated by the dispatcher (ids in range, no duplicates).
struct StorageWork {
  proto::TaskRecordHeader header{};
  std::uint32_t epoch = 0;
  ipc::StorageSection section;
  // One per key; a group session's: one per key and group, group-major (group g's block of key
  // k at g x keys + k, in the task's id space), -1 where the group has none.
  std::vector<std::int32_t> blocks;
  // The blocks the task reads or writes: `blocks` without the -1 entries (what its hazards hold).
  std::vector<std::int32_t> named_blocks() const {
    std::vector<std::int32_t> out;
    for (const std::int32_t id : blocks)
      if (id >= 0) out.push_back(id);
    return out;
  }
  // Completed already with this status (cancelled while it waited in the dispatcher, or a backup
  // skipped on arrival), its blocks released: phase 1 only aborts and leaves its agreement, in
  // ring order as every task does.
  std::optional<proto::TaskStatus> answered;
};

struct StorageStats {
  std::uint64_t tasks = 0, objects_read = 0, objects_written = 0, bytes_read = 0, bytes_written = 0;
  std::uint64_t backups_skipped = 0;  // backups not written: the store was behind, or their swap failed
};

// Where the executor reports, implemented by its owner (the task runner). Called on the
// executor's threads, concurrently; it must not call back into the executor.
class StorageListener {
 public:
  virtual ~StorageListener() = default;
  // One task's outcome on this rank (its header, what it did, when it started).
  virtual void storage_completed(const proto::TaskRecordHeader& header, const proto::Outcome& outcome,
                                 std::int64_t start_ns) = 0;
  // After each task, completed or dropped: its blocks may be released.
  virtual void storage_released(const StorageWork& work) = 0;
};

class StorageExecutor {
 public:
  // Why an executor could not be made: the flags leave a worker's slice of the staging too small
  // for one object (an operator must change them), or the staging could not be allocated.
  enum class SetupErrc { kStagingTooSmall, kNoMemory };
  // `copies` moves objects' bytes between the tensors and staging; `host_memory` gives the staging.
  // `listener` (outlives the executor) hears every completion and release.
  static Result<std::unique_ptr<StorageExecutor>, SetupErrc> create(endpoint::RankEndpoint& ep, CopyEngine& copies,
                                                                      HostMemory& host_memory, HostPool* pool,
                                                                      StorageTargets targets, StorageListener& listener);
  ~StorageExecutor();
  StorageExecutor(const StorageExecutor&) = delete;
  StorageExecutor& operator=(const StorageExecutor&) = delete;

  void submit(StorageWork&& work);
  // Answers backup `work` backup_skipped with `why` at once (its blocks released, counted as
  // skipped) and leaves its agreement in ring order, so the peers store nothing of it either.
  void skip_backup(StorageWork&& work, const std::string& why);
  // Asks a queued or running task to stop at its next step; false if it is not live here or
  // already past its last step (it will then complete as it is).
  bool cancel(std::uint64_t task_id);
  // Removes queued work (a revoked epoch); returns how many were dropped (released, no completion).
  std::size_t drop_queued();
  StorageStats stats() const;
  // Finishes the queued work and joins the workers; idempotent (the destructor calls it).
  void close();

 private:
  struct Impl;
  explicit StorageExecutor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtd::daemon
