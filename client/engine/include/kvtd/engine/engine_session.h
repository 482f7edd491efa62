// kvtd/engine/engine_session.h - the engine-side client library.
//
// The engine creates one session per data-parallel group: a shared-memory segment named
// "kvtd_<uid>_<suffix>" (mode 0600) holding the cache geometry, the tensor registry, the task
// ring and one completion ring per rank. Rank daemons attach to it. The engine registers its
// tensors, publishes the session, submits tasks and waits for their merged completions: a task
// is done when every rank reported, its status is the lowest failing rank's (if any) and its block count
// is the MIN over ranks.
//
// A background thread writes the engine heartbeat, grants rank attach requests and declares a
// rank gone when its heartbeat is older than `rank_timeout_ns` or its process exited. Before a
// silent rank's pending tasks fail, the engine fences it: SIGKILL through a pidfd to the exact
// process that was granted, then a wait (fence_timeout_ns) until it has exited. So kRankDead
// always means "that rank will write nothing more". A rank that cannot be stopped (another
// uid, no pidfd, it did not exit in time) fails its tasks with kRankUnfenced instead: their
// destination blocks may still be written and must stay out of use. A rank that detaches in
// order (SIGTERM, session lost) wrote all its completions first and fails nothing that ran.
//
// Ownership: EngineSession owns the segment and unlinks it on destruction (attached daemons
// notice the closed state and detach). Not copyable or movable.
// Thread-safety: every method may be called from any thread. Waits never hold the internal
// mutex while sleeping.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/errors.h"
#include "kvtd/ipc/process.h"
#include "kvtd/proto/expected.h"
#include "kvtd/proto/session.h"

namespace kvtd::engine {

// The session contract's types this API speaks in (kvtd/ipc).
using ipc::Clock;
using ipc::Fencer;
using ipc::IpcErrc;

struct SessionOptions {
  std::string suffix;                    // [A-Za-z0-9_.-]{1,64}, e.g. the engine's ipc_suffix
  proto::CacheGeometry geometry{};
  // Cache groups (kvtd/proto/cache_groups.h) instead of `geometry` (leave it zero): tensors are
  // registered per layer slot (proto::group_slot) and tasks name blocks in the groups' id space
  // (proto::id_space). num_groups 0: the single-shape geometry.
  proto::CacheGroups groups{};
  std::uint64_t ring_bytes = 1u << 20;   // task ring size, power of two >= 4096
  std::uint32_t completion_capacity = 4096;  // per rank; also the in-flight task limit
  std::int64_t rank_timeout_ns = 3'000'000'000;   // heartbeat age that makes a rank dead
  std::int64_t service_period_ns = 10'000'000;    // heartbeat / grant / liveness period
  bool replace_stale = true;             // remove a leftover segment whose creator is dead
  const Clock* clock = nullptr;          // defaults to monotonic_clock()
  std::int64_t fence_timeout_ns = 5'000'000'000;  // how long a killed rank may take to exit
  Fencer fencer;                         // defaults to fence_process (tests inject failures)
  std::size_t max_uncollected_results = 65536;  // finished results kept for poll/wait; oldest dropped
  std::uint64_t weight_version = 0;      // initial weight version (see set_weight_version)
  // Take over the host tier of this suffix's previous session if its engine died (it did not
  // close the session): each rank's daemon kept that session's host pool and, if it has exactly
  // this rank's shape, makes it this session's, so every block written there stays loadable (an
  // engine worker restarted beside the same daemons). A rank that did shows
  // proto::kReadyHostTierTakenOver in rank_ready_flags(). Only blocks the new session's own
  // bookkeeping still names are worth anything; the engine decides.
  bool adopt_host_tier = false;
  // Serve only this rank of the geometry's num_ranks: for an engine that runs one process per TP
  // rank (sglang's schedulers, vLLM's workers), each of which makes a session of its own (a suffix
  // per rank) for its rank alone. Its daemon runs as that rank of num_ranks (--rank r --mp-num n),
  // so it maps that rank's tensors and stores objects as that rank's slice; a daemon of another
  // rank is refused. No agreement across the processes' sessions: each answers for its rank
  // (sglang MIN-reduces storage hits and loads across its ranks itself). Unset: every rank.
  std::optional<std::uint32_t> only_rank;
  // What the KV is beyond its shape (kvtd/proto/kv_identity.h): its layout across ranks (a
  // single-shape geometry; cache groups declare theirs by kind), element type, pipeline stage and
  // context-parallel slice. Each daemon's flags (--kv-layout, --kv-dtype, --pp-*, --cp-*) must
  // declare the same or it is refused at attach; the dtype and stage enter the storage
  // namespace. An engine that runs with a pipeline or a value-less cache declares them: left
  // undeclared, a cache without a value tensor is taken for an MLA latent (FastDeploy's reading).
  proto::KvIdentity kv_identity{};
  // A caller waiting for a swap, the only one in flight in its direction, polls around when the
  // last swap of that direction says it should end (scaled by its blocks, from the ranks' own
  // timing), sleeping before that, instead of sleeping through the report and paying a wake-up.
  // Costs the waiting thread a core for the window (an eighth of the swap's time, 40-400 us).
  // false, or several swaps in flight one way: poll 20 us, then sleep.
  bool completion_forecast = true;
};

// Waits (wait()) that returned a swap's result while it had a completion forecast, counted by
// when the result was taken: before the poll window (the waiter slept and the report woke it),
// inside it (taken while polling: no wake-up paid), after it (the window missed: a wake-up paid).
struct ForecastWaits {
  std::uint64_t waits = 0;  // before_window + in_window + after_window
  std::uint64_t before_window = 0;
  std::uint64_t in_window = 0;
  std::uint64_t after_window = 0;
};

// One task. Swaps use src/dst; storage tasks use keys, blocks and the fields after them:
//   STORAGE_QUERY(keys)                  -> blocks_done = leading hits, MIN over ranks
//   STORAGE_READ(keys, blocks)           -> blocks_done = blocks loaded (the agreed prefix)
//   STORAGE_WRITE(keys, blocks)          -> blocks_done written, blocks_skipped not written
//   PREFETCH(keys, host blocks, min_hits) -> like a read into host blocks; 0 when fewer hit
//   CANCEL(cancel_task_id)               -> stops a PREFETCH or STORAGE_WRITE between objects;
//                                           that task ends kCancelled with how far it got
// Keys: 1..proto::kMaxKeyBytes of [A-Za-z0-9_.:-], one per block, at most kMaxKeysPerTask.
struct TaskRequest {
  proto::TaskKind kind = proto::TaskKind::kSwapToHost;
  std::span<const std::int32_t> src;  // SWAP_TO_HOST: device ids; SWAP_TO_DEVICE: host ids
  std::span<const std::int32_t> dst;
  // Storage tasks. With SWAP_TO_HOST, keys (one per dst block) also submit a backup task
  // (STORAGE_WRITE of the dst host blocks, id = swap id + 1) that the daemons' --write-policy
  // carries out or skips; free those host blocks only after the backup completed.
  std::span<const std::string> keys;
  std::span<const std::int32_t> blocks;  // one per key: device blocks, or host blocks (host_blocks)
  bool host_blocks = false;
  std::uint32_t min_hits = 0;            // PREFETCH
  std::uint64_t cancel_task_id = 0;      // CANCEL
  bool evict_backup = false;             // STORAGE_WRITE of host blocks being evicted (write_back)
  std::int64_t submit_timeout_ns = 1'000'000'000;  // how long submit may wait for ring room
  std::int64_t deadline_ns = 0;       // absolute CLOCK_MONOTONIC; 0 = none
  std::uint64_t after_task_id = 0;    // run after this task (0 = no constraint)
  bool layerwise = false;             // SWAP_TO_DEVICE only: copy layer by layer, with progress
  // Swap tasks: one interprocess event handle (cudaIpcEventHandle_t bytes) per rank, in rank
  // order, that the rank's engine recorded on its stream after the GPU work this copy must
  // follow (the kernels writing a SWAP_TO_HOST's blocks, the ones still reading a
  // SWAP_TO_DEVICE's destination). The daemon's copy waits for it on the GPU. Empty: the engine
  // synchronised that work before submitting. Each event must stay alive until the task completed.
  std::span<const std::array<std::uint8_t, proto::kEngineEventBytes>> engine_events;
};

// Options of EngineSession::clear_caches.
struct ClearOptions {
  bool drop_host_tier = false;                  // the host pool's KV belongs to the old weights too
  std::optional<std::uint64_t> weight_version;  // set once every rank released (storage keys carry it)
  std::int64_t timeout_ns = 60'000'000'000;     // for tasks in flight to finish and every rank to answer
};

struct RankFailure {
  std::uint32_t rank;
  proto::TaskStatus status;
  std::string message;
};

struct TaskResult {
  std::uint64_t task_id = 0;
  proto::TaskStatus status = proto::TaskStatus::kOk;  // failure of the lowest failing rank, or kOk
  std::uint64_t blocks_done = 0;                     // MIN over ranks (kCancelled: how far it got)
  std::uint64_t blocks_skipped = 0;                  // STORAGE_WRITE: MIN over ranks
  std::vector<RankFailure> failures;               // sorted by rank
  std::int64_t submit_ns = 0;
  std::int64_t complete_ns = 0;                      // when the last rank's report was merged
  // CLOCK_MONOTONIC, as the ranks wrote them into their reports (0: no rank reported one): the
  // earliest start of execution and the latest report, so a caller can tell the time a task spent
  // reaching a daemon, executing, and coming back apart.
  std::int64_t first_start_ns = 0;
  std::int64_t last_end_ns = 0;
  bool ok() const { return status == proto::TaskStatus::kOk; }
};

// Thread-safety: every method may be called from any thread. Calls made in a process other
// than the one that created the session (a forked child) are refused with kWrongProcess: the
// child shares the mapping but not the engine's state, and the two would take each other's
// completions.
class EngineSession {
 public:
  // Creates and maps the segment, state kCreating. Fails with kInUse if a live engine owns it.
  static Result<std::unique_ptr<EngineSession>, IpcErrc> create(const SessionOptions& options);
  // Closes the session: calls waiting in it on other threads return kClosed, later calls are
  // refused with kClosed, and it returns once no call is inside. The destructor does it first,
  // so destroying a session while another thread waits in it is safe; starting a call after the
  // destructor began is not (the object is going away).
  void close();
  ~EngineSession();
  // Whether calls are accepted: kClosed once closing, kWrongProcess in a forked child. Calls
  // that return a plain value (poll, rank_alive, ...) give an empty one then; this says why.
  Status<IpcErrc> usable() const;
  EngineSession(const EngineSession&) = delete;
  EngineSession& operator=(const EngineSession&) = delete;

  // Registers one tensor (desc.rank/layer/kind select the slot). Only before publish(), or
  // after clear_caches() succeeded and before restore_caches() (new handles and offsets).
  Status<IpcErrc> register_tensor(const proto::TensorDesc& desc);

  // Host device backend: creates one shared-memory "device" arena per rank, registers every
  // tensor of the geometry inside it (handle = arena name, offset = position) and maps it here.
  // Called again after clear_caches(), it frees the old arenas and makes new ones (new names).
  Status<IpcErrc> create_host_device_tensors();
  // Unmaps and unlinks the arenas of create_host_device_tensors (their registry entries become
  // unregistered). Only before publish() or after clear_caches() succeeded.
  Status<IpcErrc> free_host_device_tensors();
  // Address of a tensor made by create_host_device_tensors, or null.
  std::byte* host_device_tensor(std::uint32_t rank, std::uint32_t layer, proto::TensorKind kind) const;

  // Marks the session ready: daemons waiting on it validate and attach.
  Status<IpcErrc> publish();

  // Waits until every rank is attached with all ready flags set.
  Status<IpcErrc> wait_ready(std::int64_t timeout_ns);

  // The weight version every later storage task carries: bump it when the model's weights change
  // (an RL update), and no KV stored under other weights is ever loaded.
  void set_weight_version(std::uint64_t version);
  std::uint64_t weight_version() const;

  // Weight updates (an RL trainer swapping the model's weights under a live engine):
  // clear_caches() refuses new tasks (kCacheCleared), sends CLEAR_CACHE to every attached rank
  // and waits until each finished the tasks submitted before it and closed every mapping of the
  // engine's KV tensors (a rank that is not attached maps nothing and will not until restore).
  // Ok means every rank released: free the tensors, update the weights, allocate and
  // register_tensor() the new ones, then restore_caches(): every rank re-reads the registry and
  // re-opens it; ok means every rank serves again. kTaskFailed names the rank and the cause
  // (e.g. a new handle it could not open); the cache then stays cleared (clear, fix, restore).
  // kNotReady from clear_caches: a rank went silent and may still hold the mappings.
  Result<TaskResult, IpcErrc> clear_caches(const ClearOptions& options = {});
  Result<TaskResult, IpcErrc> restore_caches(std::int64_t timeout_ns = 60'000'000'000);
  bool cache_cleared() const;

  // Submits a task to every rank; returns its task id. Reserved kinds (0) and the cache-control
  // kinds (use clear_caches / restore_caches) are refused; so is everything while the cache is
  // cleared (kCacheCleared). Waits up to submit_timeout_ns for ring
  // room (kRingFull after that) and for an in-flight slot (kTooManyInFlight). A rank that is not
  // attached makes it fail fast with kNotReady.
  Result<std::uint64_t, IpcErrc> submit(const TaskRequest& request);

  // Test and tooling hook: writes `header` as given (kind, format_version, ids counts are NOT
  // checked), so daemons' handling of malformed tasks can be exercised.
  Result<std::uint64_t, IpcErrc> submit_raw(const proto::TaskRecordHeader& header,
                                            std::span<const std::int32_t> src,
                                            std::span<const std::int32_t> dst);

  // The merged result if every rank reported; the result is handed out once.
  std::optional<TaskResult> poll(std::uint64_t task_id);
  // Waits up to timeout_ns for the merged result (kTimeout; kUnknownTask if never submitted,
  // already collected, or dropped because more than max_uncollected_results were waiting).
  Result<TaskResult, IpcErrc> wait(std::uint64_t task_id, std::int64_t timeout_ns);

  // What wait_layer waits for.
  enum class LayerStage {
    kDone,      // the layer's copies completed on every rank (host-side wait)
    kEnqueued,  // the layer's copies are queued and its event recorded on every rank: the
                // engine may now cudaStreamWaitEvent on layer_event_handle(rank, layer)
  };

  // Layer-by-layer loads: waits until layer `layer` of task `task_id` reached `stage` on every
  // rank (true as well once the whole task completed ok). kTaskFailed if the task failed,
  // kTimeout, kUnknownTask if it was never submitted or its result was already taken by
  // wait()/poll(), kInvalidArgument if layer >= num_layers.
  Status<IpcErrc> wait_layer(std::uint64_t task_id, std::uint32_t layer, std::int64_t timeout_ns,
                             LayerStage stage = LayerStage::kDone);

  // The interprocess CUDA event rank `rank` records after enqueueing each layer's copies of a
  // layer-by-layer task (cudaIpcEventHandle_t bytes), or nullopt when that rank publishes none
  // (host backend). To let a compute stream wait on the GPU without a host round trip per copy:
  // wait_layer(id, l, t, LayerStage::kEnqueued), then cudaStreamWaitEvent on the opened event.
  // `epoch` (optional) receives the epoch of the daemon that exported it: an engine that keeps
  // opened events re-opens them when it changes (a restarted daemon exports new events).
  std::optional<std::array<std::uint8_t, proto::kHandleBytes>> layer_event_handle(std::uint32_t rank, std::uint32_t layer,
                                                                                  std::uint32_t* epoch = nullptr) const;

  // Whether rank r is attached and its heartbeat is fresh.
  bool rank_alive(std::uint32_t rank) const;
  // The rank's proto::ReadyFlag bits (cache mapped, host pool made, host tier taken over) while it
  // is alive, else 0: what FastDeploy's cache_ready / swap_space_ready signals say per rank.
  std::uint32_t rank_ready_flags(std::uint32_t rank) const;
  std::size_t in_flight() const;
  // Waits that took a swap's result around its completion forecast (SessionOptions::
  // completion_forecast), by where the result was taken: whether the forecast spares wake-ups.
  ForecastWaits forecast_waits() const;

  const proto::CacheGeometry& geometry() const;
  // The session's cache groups (num_groups 0 for a single-shape session; geometry() is then the
  // groups' envelope otherwise).
  const proto::CacheGroups& groups() const;
  const std::string& name() const;
  std::uint64_t generation() const;

 private:
  struct Impl;
  explicit EngineSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtd::engine
