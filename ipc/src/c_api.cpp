#include "kvtd/ipc/kvtd_client.h"

#include <cstdint>
#include <cstring>
#include <new>
#include <memory>
#include <string>
#include <vector>

#include "kvtd/ipc/engine_session.h"

struct kvtd_session {
  std::unique_ptr<kvtd::ipc::EngineSession> session;
};

namespace {

using kvtd::ipc::IpcErrc;

void put_error(char* err, size_t len, const std::string& msg) {
  if (!err || len == 0) return;
  const size_t n = msg.size() < len - 1 ? msg.size() : len - 1;
  std::memcpy(err, msg.data(), n);
  err[n] = '\0';
}

int code_of(IpcErrc e) {
  switch (e) {
    case IpcErrc::kTimeout: return KVTD_E_TIMEOUT;
    case IpcErrc::kRingFull:
    case IpcErrc::kTooManyInFlight: return KVTD_E_RING_FULL;
    case IpcErrc::kNotReady: return KVTD_E_NOT_READY;
    case IpcErrc::kUnknownTask: return KVTD_E_UNKNOWN_TASK;
    case IpcErrc::kInUse: return KVTD_E_IN_USE;
    case IpcErrc::kSystem: return KVTD_E_SYSTEM;
    default: return KVTD_E_INVALID;
  }
}

template <typename S>
int report(const S& st, char* err, size_t len) {
  if (st.ok()) return KVTD_OK;
  put_error(err, len, st.error().message);
  return code_of(st.error().code);
}

// Milliseconds to nanoseconds without overflow (a huge timeout saturates, it does not wrap).
std::int64_t ms_to_ns(int64_t ms) {
  if (ms <= 0) return 0;
  return ms > INT64_MAX / 1'000'000 ? INT64_MAX : ms * 1'000'000;
}

// No exception may cross extern "C": every entry point runs its body through this.
template <typename F>
int guarded(char* err, size_t len, F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    put_error(err, len, "out of memory");
    return KVTD_E_SYSTEM;
  } catch (const std::exception& e) {
    put_error(err, len, std::string("internal error: ") + e.what());
    return KVTD_E_SYSTEM;
  } catch (...) {
    put_error(err, len, "internal error");
    return KVTD_E_SYSTEM;
  }
}

int null_session(char* err, size_t len) {
  put_error(err, len, "session must not be null");
  return KVTD_E_INVALID;
}

}  // namespace

extern "C" {

int kvtd_session_create(const char* suffix, const kvtd_geometry* g, kvtd_session** out, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
  if (!suffix || !g || !out) {
    put_error(err, err_len, "suffix, geometry and out must not be null");
    return KVTD_E_INVALID;
  }
  kvtd::ipc::SessionOptions o;
  o.suffix = suffix;
  o.geometry.num_ranks = g->num_ranks;
  o.geometry.num_layers = g->num_layers;
  o.geometry.dtype = g->dtype;
  o.geometry.num_host_blocks = g->num_host_blocks;
  for (int i = 0; i < 4; ++i) {
    o.geometry.key_shape[i] = g->key_shape[i];
    o.geometry.value_shape[i] = g->value_shape[i];
  }
  auto s = kvtd::ipc::EngineSession::create(o);
  if (!s.ok()) return report(s, err, err_len);
  *out = new kvtd_session{std::move(s).value()};
  return KVTD_OK;
  });
}

void kvtd_session_destroy(kvtd_session* s) {
  (void)guarded(nullptr, 0, [&]() -> int {
    delete s;
    return KVTD_OK;
  });
}

int kvtd_register_tensor(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind, int32_t device_id,
                         const uint8_t handle[64], uint64_t offset, uint64_t bytes, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
  if (!s || !handle) {
    put_error(err, err_len, "session and handle must not be null");
    return KVTD_E_INVALID;
  }
  kvtd::proto::TensorDesc d{};
  d.rank = rank;
  d.layer = layer;
  d.kind = kind;
  d.device_id = device_id;
  d.dtype = s->session->geometry().dtype;
  d.offset = offset;
  d.bytes = bytes;
  std::memcpy(d.handle, handle, sizeof d.handle);
  return report(s->session->register_tensor(d), err, err_len);
  });
}

int kvtd_create_host_device_tensors(kvtd_session* s, char* err, size_t err_len) {
  if (!s) return null_session(err, err_len);
  return guarded(err, err_len, [&]() -> int { return report(s->session->create_host_device_tensors(), err, err_len); });
}

void* kvtd_host_device_tensor(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind) {
  if (!s || kind >= kvtd::proto::kTensorKinds) return nullptr;
  return s->session->host_device_tensor(rank, layer, static_cast<kvtd::proto::TensorKind>(kind));  // no-throw
}

int kvtd_publish(kvtd_session* s, char* err, size_t err_len) {
  if (!s) return null_session(err, err_len);
  return guarded(err, err_len, [&]() -> int { return report(s->session->publish(), err, err_len); });
}

int kvtd_wait_ready(kvtd_session* s, int64_t timeout_ms, char* err, size_t err_len) {
  if (!s) return null_session(err, err_len);
  return guarded(err, err_len, [&]() -> int { return report(s->session->wait_ready(ms_to_ns(timeout_ms)), err, err_len); });
}

int kvtd_submit(kvtd_session* s, int kind, const int32_t* src, const int32_t* dst, size_t n, int64_t timeout_ms,
                uint64_t* task_id, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
  if (!s || !task_id || (n > 0 && (!src || !dst))) {
    put_error(err, err_len, "session, task_id and id arrays must not be null");
    return KVTD_E_INVALID;
  }
  kvtd::ipc::TaskRequest r;
  r.kind = static_cast<kvtd::proto::TaskKind>(kind);
  r.src = {src, n};
  r.dst = {dst, n};
  r.submit_timeout_ns = ms_to_ns(timeout_ms);
  auto id = s->session->submit(r);
  if (!id.ok()) return report(id, err, err_len);
  *task_id = *id;
  return KVTD_OK;
  });
}

int kvtd_submit_storage(kvtd_session* s, int kind, const char* const* keys, const int32_t* blocks, size_t n,
                        uint32_t flags, uint32_t min_hits, uint64_t cancel_task_id, int64_t timeout_ms,
                        uint64_t* task_id, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
  const bool query = kind == KVTD_STORAGE_QUERY;
  if (!s || !task_id || (n > 0 && (!keys || (!query && !blocks)))) {
    put_error(err, err_len, "session, task_id, keys and (except for a query) blocks must not be null");
    return KVTD_E_INVALID;
  }
  if (n > kvtd::proto::kMaxKeysPerTask) {
    put_error(err, err_len, std::to_string(n) + " keys exceed the limit of " + std::to_string(kvtd::proto::kMaxKeysPerTask));
    return KVTD_E_INVALID;
  }
  if ((flags & ~uint32_t{KVTD_STORAGE_HOST_BLOCKS | KVTD_STORAGE_EVICT_BACKUP}) != 0) {
    put_error(err, err_len, "unknown storage flags " + std::to_string(flags));
    return KVTD_E_INVALID;
  }
  std::vector<std::string> key_list;
  key_list.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!keys[i]) {
      put_error(err, err_len, "key " + std::to_string(i) + " is null");
      return KVTD_E_INVALID;
    }
    key_list.emplace_back(keys[i], strnlen(keys[i], kvtd::proto::kMaxKeyBytes + 1));
  }
  kvtd::ipc::TaskRequest r;
  r.kind = static_cast<kvtd::proto::TaskKind>(kind);
  r.keys = key_list;
  if (!query && n > 0) r.blocks = {blocks, n};
  r.host_blocks = (flags & KVTD_STORAGE_HOST_BLOCKS) != 0;
  r.evict_backup = (flags & KVTD_STORAGE_EVICT_BACKUP) != 0;
  r.min_hits = min_hits;
  r.cancel_task_id = cancel_task_id;
  r.submit_timeout_ns = ms_to_ns(timeout_ms);
  auto id = s->session->submit(r);
  if (!id.ok()) return report(id, err, err_len);
  *task_id = *id;
  return KVTD_OK;
  });
}

int kvtd_set_weight_version(kvtd_session* s, uint64_t version) {
  if (!s) return KVTD_E_INVALID;
  return guarded(nullptr, 0, [&]() -> int {
    s->session->set_weight_version(version);
    return KVTD_OK;
  });
}

int kvtd_wait(kvtd_session* s, uint64_t task_id, int64_t timeout_ms, kvtd_completion* out, char* err,
              size_t err_len) {
  if (!s) return null_session(err, err_len);
  return guarded(err, err_len, [&]() -> int {
  auto r = s->session->wait(task_id, ms_to_ns(timeout_ms));
  if (!r.ok()) return report(r, err, err_len);
  if (out) {
    out->task_id = r->task_id;
    out->status = static_cast<int32_t>(r->status);
    out->failed_rank = r->failures.empty() ? -1 : static_cast<int32_t>(r->failures.front().rank);
    out->blocks_done = r->blocks_done;
    out->blocks_skipped = r->blocks_skipped;
    out->latency_ns = r->complete_ns - r->submit_ns;
  }
  if (r->ok()) return KVTD_OK;
  put_error(err, err_len, "rank " + std::to_string(r->failures.front().rank) + ": " + r->failures.front().message);
  return KVTD_E_TASK_FAILED;
  });
}

int kvtd_rank_alive(kvtd_session* s, uint32_t rank) {
  if (!s) return 0;
  return guarded(nullptr, 0, [&]() -> int { return s->session->rank_alive(rank) ? 1 : 0; });
}

}  // extern "C"
