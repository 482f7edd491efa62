/* kvtd/kvtd_client.h - C ABI of the engine-side client library, libkvtd_client.so (for Python
 * through ctypes and for engines in any language).
 *
 * An engine creates one session per data-parallel group, registers its KV tensors, publishes the
 * session, waits until every rank daemon attached, then submits tasks and waits for their merged
 * completions (a task is done when every rank reported; its status is the lowest failing rank's,
 * its block count the MIN over ranks). See kvtd/engine/engine_session.h for the full contract.
 *
 * Errors: every int-returning function returns KVTD_OK (0) or a positive KVTD_E_* code; when
 * `err` is non-null a NUL-terminated message naming the problem is written to it (at most
 * err_len bytes, truncated). No C++ exception crosses this interface; null pointers and
 * out-of-range values are refused with KVTD_E_INVALID.
 * Ownership: kvtd_session_create allocates the handle; kvtd_session_destroy frees it, unlinks
 * the session and every shared object it made (attached daemons notice and detach).
 * Thread-safety: a handle may be used from several threads at once. kvtd_session_destroy wakes
 * the calls waiting in the session on other threads (they return KVTD_E_CLOSED) and frees the
 * handle once none is inside. A call on a destroyed handle (or one being destroyed) is refused
 * with KVTD_E_CLOSED, and a second destroy of one handle does nothing: the library keeps a table
 * of live handles and never reuses a destroyed one's address. A handle used in a process
 * other than its creator (a forked child) is refused with KVTD_E_WRONG_PROCESS. Waits never hold
 * a lock while sleeping; a caller in Python (ctypes) waits with the GIL released.
 * Versioning: the SONAME is libkvtd_client.so.<KVTD_CLIENT_ABI>; structs may only grow at the
 * end in a new ABI version.
 */
#ifndef KVTD_KVTD_CLIENT_H_
#define KVTD_KVTD_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVTD_CLIENT_ABI 1

#if defined(__GNUC__)
#define KVTD_API __attribute__((visibility("default")))
#else
#define KVTD_API
#endif

enum {
  KVTD_OK = 0,
  KVTD_E_INVALID = 1,
  KVTD_E_TIMEOUT = 2,
  KVTD_E_RING_FULL = 3,     /* no ring room or too many tasks in flight within the submit timeout */
  KVTD_E_NOT_READY = 4,     /* a rank is not attached (or the session is not published) */
  KVTD_E_UNKNOWN_TASK = 5,  /* never submitted, or its result was already taken */
  KVTD_E_IN_USE = 6,        /* a live engine owns this session name */
  KVTD_E_SYSTEM = 7,        /* an OS call failed (no memory, /dev/shm full, ...) */
  KVTD_E_TASK_FAILED = 8,   /* the task completed with a failure (see kvtd_completion.status) */
  KVTD_E_PENDING = 9,       /* kvtd_poll: not complete yet */
  KVTD_E_NO_EVENT = 10,     /* kvtd_layer_event_handle: that rank publishes no CUDA events */
  KVTD_E_CACHE_CLEARED = 11, /* the cache is cleared for a weight update: kvtd_restore_caches first */
  KVTD_E_CLOSED = 12,        /* the session is being destroyed (a call that was waiting in it) */
  KVTD_E_WRONG_PROCESS = 13  /* the session was created by another process (a forked child) */
};

enum {
  KVTD_SWAP_TO_HOST = 1,
  KVTD_SWAP_TO_DEVICE = 2,
  KVTD_STORAGE_QUERY = 3,
  KVTD_STORAGE_READ = 4,
  KVTD_STORAGE_WRITE = 5,
  KVTD_PREFETCH = 6,
  KVTD_CANCEL = 7
};
/* kvtd_task.flags (and kvtd_submit_storage flags) */
enum {
  KVTD_STORAGE_HOST_BLOCKS = 1u << 0,  /* storage blocks are host-pool blocks, not device blocks */
  KVTD_STORAGE_EVICT_BACKUP = 1u << 1, /* STORAGE_WRITE of host blocks being evicted (write_back) */
  KVTD_TASK_LAYERWISE = 1u << 2        /* SWAP_TO_DEVICE: layer by layer, with per-layer progress */
};
enum { KVTD_DTYPE_BFLOAT16 = 1, KVTD_DTYPE_FLOAT16 = 2, KVTD_DTYPE_UINT8 = 3, KVTD_DTYPE_BLOCK_WISE_FP8 = 4 };
/* KVTD_READY_HOST_TIER_TAKEN_OVER: the rank's host pool is the one its daemon kept when this
 * suffix's previous session's engine died (kvtd_session_create_adopting). */
enum { KVTD_READY_CACHE = 1u << 0, KVTD_READY_HOST_POOL = 1u << 1, KVTD_READY_HOST_TIER_TAKEN_OVER = 1u << 2 };
enum { KVTD_KEY = 0, KVTD_VALUE = 1, KVTD_KEY_SCALE = 2, KVTD_VALUE_SCALE = 3 };
/* kvtd_clear_caches flags */
enum {
  KVTD_CLEAR_DROP_HOST_TIER = 1u << 0,      /* the host pool's KV is the old weights' too: invalidate it */
  KVTD_CLEAR_SET_WEIGHT_VERSION = 1u << 1   /* then set the weight version to `weight_version` */
};
/* kvtd_wait_layer stages */
enum {
  KVTD_LAYER_DONE = 0,     /* the layer's copies completed on every rank */
  KVTD_LAYER_ENQUEUED = 1  /* queued and its CUDA event recorded on every rank (then cudaStreamWaitEvent) */
};

typedef struct kvtd_geometry {
  uint32_t num_ranks;
  uint32_t num_layers;        /* every layer with a KV cache, extra (MTP) layers included */
  uint32_t dtype;             /* KVTD_DTYPE_* */
  uint32_t num_host_blocks;   /* host pool blocks per rank */
  int64_t key_shape[4];       /* device blocks, kv heads, block size, head dim (3-D caches: 1) */
  int64_t value_shape[4];     /* all zero: no value cache (MLA) */
  uint32_t scale_bytes;       /* block_wise_fp8 scale element bytes: 2 or 4 (0 = 2) */
  uint32_t num_extra_layers;  /* the last num_extra_layers of num_layers are extra layers */
  int64_t extra_device_blocks; /* device blocks of each extra layer (0 without extra layers) */
} kvtd_geometry;

/* A KV cache as cache groups (kvtd/proto/cache_groups.h says the rules): hybrid models keep
 * sliding-window, full-attention, state (Mamba / linear attention), MLA latent and indexer
 * caches side by side. Layer l of a group: bit l % 64 of layers[l / 64]. */
enum {
  KVTD_GROUP_FULL_ATTENTION = 1,
  KVTD_GROUP_MLA_LATENT = 2,
  KVTD_GROUP_SLIDING_WINDOW = 3,
  KVTD_GROUP_STATE = 4,
  KVTD_GROUP_INDEXER = 5
};
#define KVTD_MAX_GROUPS 8
typedef struct kvtd_group_tensor {
  uint32_t element_bytes;  /* 1, 2 or 4 */
  uint32_t ndim;           /* 1..3: dims of one block (slot), the block dimension left out */
  int64_t dims[3];
} kvtd_group_tensor;
typedef struct kvtd_cache_group {
  uint32_t kind;           /* KVTD_GROUP_* */
  uint32_t num_tensors;    /* tensors per layer, 1..4 */
  uint32_t block_tokens;   /* page_tokens; 0 for a state group (one slot per request) */
  uint32_t window_tokens;  /* sliding window only */
  int64_t device_blocks;
  uint32_t host_blocks;
  uint32_t reserved;       /* 0 */
  uint64_t layers[8];
  kvtd_group_tensor tensors[4];
} kvtd_cache_group;
typedef struct kvtd_cache_groups {
  uint32_t num_ranks;
  uint32_t num_groups;     /* 1..KVTD_MAX_GROUPS */
  uint32_t page_tokens;    /* tokens per storage key */
  uint32_t reserved;       /* 0 */
  kvtd_cache_group groups[KVTD_MAX_GROUPS];
} kvtd_cache_groups;

typedef struct kvtd_completion {
  uint64_t task_id;
  int32_t status;          /* 0 ok, else the lowest failing rank's status (kvtd_status_name) */
  int32_t failed_rank;     /* -1 if ok */
  uint64_t blocks_done;    /* MIN over ranks (cancelled: how far it got) */
  int64_t latency_ns;      /* submit to merged completion */
  uint64_t blocks_skipped; /* STORAGE_WRITE: not written (stored already, or not selected by the policy) */
} kvtd_completion;

/* One task of any kind. Zero-initialise, then set what the kind uses:
 *   swaps:   src, dst, n (device <-> host block ids; flags KVTD_TASK_LAYERWISE for a load);
 *            SWAP_TO_HOST with keys (one per dst host block) also submits its backup
 *            STORAGE_WRITE with id + 1, which the daemons' write policy carries out or skips.
 *   storage: keys (num_keys NUL-terminated keys, 1..128 of [A-Za-z0-9_.:-]) and blocks (one per
 *            key; a session of cache groups: one per key and group, see kvtd_session_create_groups;
 *            null for STORAGE_QUERY); PREFETCH: min_hits; CANCEL: cancel_task_id only.
 * Every kind: deadline_ns (absolute CLOCK_MONOTONIC, 0 = none), after_task_id (run after that
 * task, 0 = none), submit_timeout_ms (how long submit may wait for ring room; 0 = do not wait). */
typedef struct kvtd_task {
  int32_t kind;            /* KVTD_SWAP_TO_HOST ... KVTD_CANCEL */
  uint32_t flags;          /* KVTD_STORAGE_*, KVTD_TASK_LAYERWISE */
  const int32_t* src;
  const int32_t* dst;
  size_t n;
  const char* const* keys;
  const int32_t* blocks;
  size_t num_keys;
  uint32_t min_hits;
  uint32_t reserved;       /* must be 0 */
  uint64_t cancel_task_id;
  uint64_t after_task_id;
  int64_t deadline_ns;
  int64_t submit_timeout_ms;
} kvtd_task;

typedef struct kvtd_session kvtd_session;

/* The ABI version this library implements (KVTD_CLIENT_ABI it was built with). */
KVTD_API int kvtd_client_abi(void);
/* Name of a task status ("ok", "id_out_of_range", ...) or of a KVTD_E_* code; never null. */
KVTD_API const char* kvtd_status_name(int32_t status);
KVTD_API const char* kvtd_error_name(int code);
/* CLOCK_MONOTONIC in nanoseconds: the clock of kvtd_task.deadline_ns. */
KVTD_API int64_t kvtd_now_ns(void);
/* kvtd's version ("0.1.0"); never null. */
KVTD_API const char* kvtd_version(void);

/* The geometry rules, asked of the library instead of re-derived (the Python module does):
 * kvtd_geometry_check: KVTD_OK when kvtd_session_create would accept the geometry, else
 *   KVTD_E_INVALID naming the first problem in err.
 * kvtd_tensor_shape: the shape of layer `layer`'s tensor of `kind` (KVTD_KEY ... KVTD_VALUE_SCALE)
 *   as the engine allocates it: *ndim 4 (data) or 3 (scales, no head_dim), shape[0] the layer's
 *   device blocks, *block_bytes one block of it, *bytes the whole tensor. A tensor the geometry
 *   does not have (no value cache, no scales) gives KVTD_OK with *ndim 0 and sizes 0. Any output
 *   pointer may be null. KVTD_E_INVALID for an invalid geometry, layer or kind. */
KVTD_API int kvtd_geometry_check(const kvtd_geometry* geometry, char* err, size_t err_len);
KVTD_API int kvtd_tensor_shape(const kvtd_geometry* geometry, uint32_t layer, uint32_t kind, int64_t shape[4],
                               uint32_t* ndim, uint64_t* block_bytes, uint64_t* bytes, char* err, size_t err_len);

/* The cache-group rules, asked of the library:
 * kvtd_groups_check: KVTD_OK for a valid group list, else KVTD_E_INVALID naming the first problem.
 * kvtd_groups_of_geometry: a single-shape geometry as groups (mla != 0: declared MLA latent).
 * kvtd_group_sizes: per group, one block across its layers and tensors and its host pool bytes
 *   (arrays of KVTD_MAX_GROUPS; either may be null).
 * kvtd_group_hits: the loadable prefix of num_keys keys given present[g * num_keys + k] (nonzero:
 *   group g's object of key k is stored): *pages where every group's rule holds, group_pages[g]
 *   each group's own answer (may be null). */
KVTD_API int kvtd_groups_check(const kvtd_cache_groups* groups, char* err, size_t err_len);
/* kvtd_group_spec: group `group` as the text of the daemon's --cache-group flag (NUL-terminated). */
KVTD_API int kvtd_group_spec(const kvtd_cache_groups* groups, uint32_t group, char* out, size_t out_len, char* err,
                             size_t err_len);
KVTD_API int kvtd_groups_of_geometry(const kvtd_geometry* geometry, int mla, kvtd_cache_groups* out, char* err,
                                     size_t err_len);
KVTD_API int kvtd_group_sizes(const kvtd_cache_groups* groups, uint64_t block_bytes[KVTD_MAX_GROUPS],
                              uint64_t host_pool_bytes[KVTD_MAX_GROUPS], char* err, size_t err_len);
KVTD_API int kvtd_group_hits(const kvtd_cache_groups* groups, uint32_t num_keys, const uint8_t* present,
                             uint32_t* pages, uint32_t group_pages[KVTD_MAX_GROUPS], char* err, size_t err_len);

KVTD_API int kvtd_session_create(const char* suffix, const kvtd_geometry* geometry, kvtd_session** out, char* err,
                                 size_t err_len);
/* A session whose cache is cache groups (swaps, whole or layer by layer, and storage tasks).
 * Tensors are registered per layer slot: slot k of a layer holds its attention group's tensors,
 * then its indexer group's (kvtd/proto/group_slots.h); kvtd_host_device_tensor's `kind` is that
 * slot. Tasks name blocks in one id space: group g's block b is the sum of the block counts of
 * groups 0..g-1 (device or host side) plus b. A storage task's blocks are num_keys x num_groups,
 * group-major (group g's block of key k at g * num_keys + k, in that id space; -1: the group has
 * none there). A load takes, at the longest prefix every group's rule allows on every rank
 * (kvtd_group_hits), only the pages each rule needs; a write stores every named block. A swap
 * with keys (its backup) is refused: submit the STORAGE_WRITE. */
KVTD_API int kvtd_session_create_groups(const char* suffix, const kvtd_cache_groups* groups, kvtd_session** out,
                                        char* err, size_t err_len);
/* Like kvtd_session_create, and if this suffix's previous session's engine died (it was not
 * destroyed), asks each rank's daemon to take over the host pool it kept from that session when
 * the pool has exactly this geometry: every host block written there stays loadable (an engine
 * worker restarted beside the same daemons). A rank that did shows
 * KVTD_READY_HOST_TIER_TAKEN_OVER in kvtd_rank_ready once it is ready. */
KVTD_API int kvtd_session_create_adopting(const char* suffix, const kvtd_geometry* geometry, kvtd_session** out,
                                          char* err, size_t err_len);
/* What kvtd_session_create_with takes beyond the geometry. KVTD_SESSION_ADOPT_HOST_TIER: as
 * kvtd_session_create_adopting. KVTD_SESSION_ONLY_RANK: the session serves rank only_rank of the
 * geometry's num_ranks alone, for an engine that runs one process per TP rank (each makes its own
 * session, a suffix per rank); that rank's daemon runs as that rank of num_ranks, a daemon of
 * another rank is refused. KVTD_SESSION_NO_COMPLETION_FORECAST: a kvtd_wait for a swap alone in
 * flight in its direction does not poll around the swap's forecast end (by default it sleeps until
 * just before it, then spends the waiting thread's core for a window of an eighth of the swap,
 * 40-400 us, instead of paying a wake-up after the report); it polls 20 us, then sleeps, as for
 * every other task. Other flag bits are refused (KVTD_E_INVALID). */
enum {
  KVTD_SESSION_ADOPT_HOST_TIER = 1u << 0,
  KVTD_SESSION_ONLY_RANK = 1u << 1,
  KVTD_SESSION_NO_COMPLETION_FORECAST = 1u << 2,
  KVTD_SESSION_KV_IDENTITY = 1u << 3
};
/* What the KV is beyond its shape (KVTD_SESSION_KV_IDENTITY; kvtd/proto/kv_identity.h). layout:
 * KVTD_KV_LAYOUT_PER_RANK (each rank its own bytes: heads, a cross-layer slab) or
 * KVTD_KV_LAYOUT_REPLICATED (an MLA latent: every rank the same bytes); UNDECLARED reads a cache
 * without a value tensor as an MLA latent (FastDeploy's launch line); a session of cache groups
 * leaves it UNDECLARED. dtype: the engine's element type by its own name, 1-15 of [a-z0-9_],
 * NUL-padded ("" none). pp_rank/pp_size, cp_rank/cp_size: the pipeline stage and
 * context-parallel slice of the session's KV (sizes 0 or 1: none). Each daemon's --kv-layout,
 * --kv-dtype, --pp-rank/--pp-size and --cp-rank/--cp-size must say the same, or it is refused at
 * attach; dtype and stage enter the storage namespace. */
enum { KVTD_KV_LAYOUT_UNDECLARED = 0, KVTD_KV_LAYOUT_PER_RANK = 1, KVTD_KV_LAYOUT_REPLICATED = 2 };
typedef struct kvtd_kv_identity {
  uint32_t layout;
  char dtype[16];
  uint16_t pp_rank, pp_size;
  uint16_t cp_rank, cp_size;
} kvtd_kv_identity;
/* Callers built before KVTD_SESSION_KV_IDENTITY pass the struct without kv_identity: it is read
 * only when that flag is set. */
typedef struct kvtd_session_options {
  uint32_t flags;     /* KVTD_SESSION_* bits */
  uint32_t only_rank; /* with KVTD_SESSION_ONLY_RANK */
  kvtd_kv_identity kv_identity; /* with KVTD_SESSION_KV_IDENTITY */
} kvtd_session_options;
KVTD_API int kvtd_session_create_with(const char* suffix, const kvtd_geometry* geometry,
                                      const kvtd_session_options* options, kvtd_session** out, char* err,
                                      size_t err_len);
/* Like kvtd_session_create_groups, with options: KVTD_SESSION_NO_COMPLETION_FORECAST,
 * KVTD_SESSION_KV_IDENTITY (its layout UNDECLARED) and KVTD_SESSION_ONLY_RANK (an engine with one
 * process per rank: vLLM's workers, sglang's schedulers) apply to a session over cache groups;
 * other flag bits are refused (KVTD_E_INVALID). */
KVTD_API int kvtd_session_create_groups_with(const char* suffix, const kvtd_cache_groups* groups,
                                             const kvtd_session_options* options, kvtd_session** out, char* err,
                                             size_t err_len);
KVTD_API void kvtd_session_destroy(kvtd_session* s);
/* The session's geometry as validated at create. */
KVTD_API int kvtd_session_geometry(kvtd_session* s, kvtd_geometry* out);

/* Registers one device tensor by its CUDA IPC handle (64 bytes) of the allocation's base plus the
 * tensor's byte offset in it (caching allocators sub-allocate). Only before kvtd_publish (or
 * after kvtd_clear_caches). The daemon matches the GPU by device_id, an ordinal of the engine's
 * process: kvtd_register_tensor_on also names the GPU by its PCI bus id ("0000:3b:00.0", CUDA's
 * cudaDeviceGetPCIBusId or NVML's spelling), which holds whatever CUDA_VISIBLE_DEVICES says. */
KVTD_API int kvtd_register_tensor(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind, int32_t device_id,
                                  const uint8_t handle[64], uint64_t offset, uint64_t bytes, char* err, size_t err_len);
KVTD_API int kvtd_register_tensor_on(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind, int32_t device_id,
                                     const char* pci_bus_id, const uint8_t handle[64], uint64_t offset, uint64_t bytes,
                                     char* err, size_t err_len);
/* Host backend: creates shared-memory "device" tensors for every rank and layer (registered). */
KVTD_API int kvtd_create_host_device_tensors(kvtd_session* s, char* err, size_t err_len);
/* Address of a tensor made by kvtd_create_host_device_tensors, or null; *bytes (if non-null) gets its size. */
KVTD_API void* kvtd_host_device_tensor(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind, uint64_t* bytes);
KVTD_API int kvtd_publish(kvtd_session* s, char* err, size_t err_len);
KVTD_API int kvtd_wait_ready(kvtd_session* s, int64_t timeout_ms, char* err, size_t err_len);

/* Submits a task to every rank; *task_id gets its id. */
KVTD_API int kvtd_submit_task(kvtd_session* s, const kvtd_task* task, uint64_t* task_id, char* err, size_t err_len);
/* A swap task whose copies wait (on the GPU) for the engine's work: `events` holds num_events
 * (= the session's ranks) 64-byte cudaIpcEventHandle_t, rank after rank, each of an
 * interprocess event (cudaEventInterprocess | cudaEventDisableTiming) that rank's engine
 * recorded on its stream after the kernels writing the SWAP_TO_HOST's blocks (or still reading
 * the SWAP_TO_DEVICE's destination). Without events the engine must have synchronised that
 * work before submitting. Keep each event alive until the task completed. */
KVTD_API int kvtd_submit_task_after_events(kvtd_session* s, const kvtd_task* task, const uint8_t* events,
                                           size_t num_events, uint64_t* task_id, char* err, size_t err_len);
/* Shorthands: a swap without options; a storage task (see kvtd_task for the fields). */
KVTD_API int kvtd_submit(kvtd_session* s, int kind, const int32_t* src_ids, const int32_t* dst_ids, size_t n,
                         int64_t timeout_ms, uint64_t* task_id, char* err, size_t err_len);
KVTD_API int kvtd_submit_storage(kvtd_session* s, int kind, const char* const* keys, const int32_t* blocks, size_t n,
                                 uint32_t flags, uint32_t min_hits, uint64_t cancel_task_id, int64_t timeout_ms,
                                 uint64_t* task_id, char* err, size_t err_len);
/* The weight version later storage tasks carry (bump on a weight update: older KV then misses). */
KVTD_API int kvtd_set_weight_version(kvtd_session* s, uint64_t version);
KVTD_API uint64_t kvtd_weight_version(kvtd_session* s);
/* The segment's name ("kvtd_<uid>_<suffix>") and random generation; "" / 0 for a null session. */
KVTD_API const char* kvtd_session_name(kvtd_session* s);
KVTD_API uint64_t kvtd_session_generation(kvtd_session* s);

/* Waits for the merged result: KVTD_OK (done, ok), KVTD_E_TASK_FAILED (done, failed: message in
 * err), KVTD_E_TIMEOUT, KVTD_E_UNKNOWN_TASK. A result is handed out once (wait or poll). */
KVTD_API int kvtd_wait(kvtd_session* s, uint64_t task_id, int64_t timeout_ms, kvtd_completion* out, char* err,
                       size_t err_len);
/* Like kvtd_wait without waiting: KVTD_E_PENDING while any rank has not reported. */
KVTD_API int kvtd_poll(kvtd_session* s, uint64_t task_id, kvtd_completion* out, char* err, size_t err_len);
/* Layer-by-layer loads: waits until `layer` of a KVTD_TASK_LAYERWISE task reached `stage`
 * (KVTD_LAYER_*) on every rank. KVTD_E_TASK_FAILED if the task failed, KVTD_E_TIMEOUT,
 * KVTD_E_UNKNOWN_TASK once its result was taken, KVTD_E_INVALID for a layer outside the geometry. */
KVTD_API int kvtd_wait_layer(kvtd_session* s, uint64_t task_id, uint32_t layer, int64_t timeout_ms, int stage,
                             char* err, size_t err_len);
/* The interprocess CUDA event (cudaIpcEventHandle_t, 64 bytes) rank `rank` records after
 * enqueueing each layer of a layer-by-layer load; KVTD_E_NO_EVENT when it publishes none (host
 * backend, or not attached). */
KVTD_API int kvtd_layer_event_handle(kvtd_session* s, uint32_t rank, uint32_t layer, uint8_t out[64]);
/* The same, plus in *epoch the epoch of the daemon that exported it: events opened under one
 * epoch must be opened again when it changes (a restarted daemon exports new ones). */
KVTD_API int kvtd_layer_event(kvtd_session* s, uint32_t rank, uint32_t layer, uint8_t out[64], uint32_t* epoch);
/* 1 if rank is attached and its heartbeat is fresh, else 0. */
KVTD_API int kvtd_rank_alive(kvtd_session* s, uint32_t rank);
/* While rank is alive, its KVTD_READY_* bits (cache tensors mapped, host pool made), else 0. */
KVTD_API uint32_t kvtd_rank_ready(kvtd_session* s, uint32_t rank);
/* Tasks submitted and not yet collected. */
KVTD_API size_t kvtd_in_flight(kvtd_session* s);
/* Waits (kvtd_wait) that took a swap's result around its completion forecast (see
 * KVTD_SESSION_NO_COMPLETION_FORECAST), by when the result was taken: before the poll window (the
 * waiter slept and the report woke it), inside it (taken while polling, no wake-up paid), after it
 * (the window missed). waits is the sum of the three. */
typedef struct kvtd_forecast_waits {
  uint64_t waits;
  uint64_t before_window;
  uint64_t in_window;
  uint64_t after_window;
} kvtd_forecast_waits;
KVTD_API int kvtd_session_forecast_waits(kvtd_session* s, kvtd_forecast_waits* out, char* err, size_t err_len);

/* Weight updates (an RL trainer swapping the weights under a live engine). kvtd_clear_caches
 * refuses new tasks (KVTD_E_CACHE_CLEARED), and returns KVTD_OK once every rank finished the
 * tasks submitted before it and closed every mapping of the KV tensors: then free them, update
 * the weights, allocate and kvtd_register_tensor the new ones (kvtd_create_host_device_tensors
 * on the host backend makes new arenas), and kvtd_restore_caches: KVTD_OK once every rank maps
 * the new tensors. KVTD_E_TASK_FAILED names the rank and cause in err (the cache stays cleared:
 * clear, fix, restore again); KVTD_E_NOT_READY: a rank went silent and may still map them. */
KVTD_API int kvtd_clear_caches(kvtd_session* s, uint32_t flags, uint64_t weight_version, int64_t timeout_ms,
                               char* err, size_t err_len);
KVTD_API int kvtd_restore_caches(kvtd_session* s, int64_t timeout_ms, char* err, size_t err_len);
/* 1 while cleared (between kvtd_clear_caches and a successful kvtd_restore_caches), else 0. */
KVTD_API int kvtd_cache_cleared(kvtd_session* s);
/* Unmaps and unlinks the arenas of kvtd_create_host_device_tensors (before publish, or cleared). */
KVTD_API int kvtd_free_host_device_tensors(kvtd_session* s, char* err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* KVTD_KVTD_CLIENT_H_ */
