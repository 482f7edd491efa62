/* kvtd/ipc/kvtd_client.h - C ABI of the engine-side client library (for Python and other
 * engines that bind through ctypes/cffi).
 *
 * Every function returns 0 on success or a positive KVTD_E_* code; when `err` is non-null, a
 * NUL-terminated message naming the problem is written to it (at most err_len bytes).
 * Ownership: kvtd_session_create allocates the handle; kvtd_session_destroy frees it and
 * unlinks the session. Thread-safety: a handle may be used from several threads at once.
 */
#ifndef KVTD_IPC_KVTD_CLIENT_H_
#define KVTD_IPC_KVTD_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  KVTD_OK = 0,
  KVTD_E_INVALID = 1,
  KVTD_E_TIMEOUT = 2,
  KVTD_E_RING_FULL = 3,
  KVTD_E_NOT_READY = 4,
  KVTD_E_UNKNOWN_TASK = 5,
  KVTD_E_IN_USE = 6,
  KVTD_E_SYSTEM = 7,
  KVTD_E_TASK_FAILED = 8 /* kvtd_wait: the task completed with a failure (see status) */
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
/* kvtd_submit_storage flags */
enum { KVTD_STORAGE_HOST_BLOCKS = 1u << 0, KVTD_STORAGE_EVICT_BACKUP = 1u << 1 };
enum { KVTD_DTYPE_BFLOAT16 = 1, KVTD_DTYPE_FLOAT16 = 2, KVTD_DTYPE_UINT8 = 3, KVTD_DTYPE_BLOCK_WISE_FP8 = 4 };

typedef struct kvtd_geometry {
  uint32_t num_ranks;
  uint32_t num_layers;
  uint32_t dtype; /* KVTD_DTYPE_* */
  uint32_t num_host_blocks;
  int64_t key_shape[4];   /* blocks, kv heads, block size, head dim */
  int64_t value_shape[4]; /* all zero: no value cache */
} kvtd_geometry;

typedef struct kvtd_completion {
  uint64_t task_id;
  int32_t status;      /* 0 ok, else the first failing rank's TaskStatus */
  int32_t failed_rank; /* -1 if ok */
  uint64_t blocks_done; /* MIN over ranks (cancelled: how far it got) */
  int64_t latency_ns;   /* submit to merged completion */
  uint64_t blocks_skipped; /* STORAGE_WRITE: not written (stored already, or not selected by the policy) */
} kvtd_completion;

typedef struct kvtd_session kvtd_session;

int kvtd_session_create(const char* suffix, const kvtd_geometry* geometry, kvtd_session** out, char* err,
                        size_t err_len);
void kvtd_session_destroy(kvtd_session* s);

/* Registers one device tensor by its CUDA IPC handle (64 bytes) plus byte offset. */
int kvtd_register_tensor(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind, int32_t device_id,
                         const uint8_t handle[64], uint64_t offset, uint64_t bytes, char* err, size_t err_len);
/* Host backend: creates shared-memory "device" tensors for every rank and layer. */
int kvtd_create_host_device_tensors(kvtd_session* s, char* err, size_t err_len);
void* kvtd_host_device_tensor(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind);
int kvtd_publish(kvtd_session* s, char* err, size_t err_len);
int kvtd_wait_ready(kvtd_session* s, int64_t timeout_ms, char* err, size_t err_len);

int kvtd_submit(kvtd_session* s, int kind, const int32_t* src_ids, const int32_t* dst_ids, size_t n,
                int64_t timeout_ms, uint64_t* task_id, char* err, size_t err_len);
/* A storage task (see kvtd/ipc/engine_session.h for what each kind does): `keys` are n
 * NUL-terminated engine keys (1..128 of [A-Za-z0-9_.:-]) and `blocks` n block ids (null for
 * QUERY; device blocks unless KVTD_STORAGE_HOST_BLOCKS). CANCEL: n = 0, cancel_task_id set. */
int kvtd_submit_storage(kvtd_session* s, int kind, const char* const* keys, const int32_t* blocks, size_t n,
                        uint32_t flags, uint32_t min_hits, uint64_t cancel_task_id, int64_t timeout_ms,
                        uint64_t* task_id, char* err, size_t err_len);
/* The weight version later storage tasks carry (bump on a weight update: older KV then misses). */
int kvtd_set_weight_version(kvtd_session* s, uint64_t version);
/* Returns KVTD_OK (done, ok), KVTD_E_TASK_FAILED (done, failed: message in err) or KVTD_E_TIMEOUT. */
int kvtd_wait(kvtd_session* s, uint64_t task_id, int64_t timeout_ms, kvtd_completion* out, char* err,
              size_t err_len);
int kvtd_rank_alive(kvtd_session* s, uint32_t rank);

#ifdef __cplusplus
}
#endif

#endif /* KVTD_IPC_KVTD_CLIENT_H_ */
