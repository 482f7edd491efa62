// The C ABI of kvtd/kvtd_client.h over engine::EngineSession. Every entry point is noexcept in
// effect: its body runs inside guarded(), so no C++ exception reaches a C or Python caller.
#include "kvtd/kvtd_client.h"

#include "c_api_handles.h"
#include "c_api_support.h"
#include "c_api_task.h"

#include <time.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <vector>

#include "kvtd/engine/engine_session.h"
#include "kvtd/proto/pci.h"
#include "kvtd/proto/task.h"

namespace {

using kvtd::c_api::guarded;
using kvtd::c_api::ms_to_ns;
using kvtd::c_api::to_request;
using kvtd::c_api::invalid;
using kvtd::c_api::closed;
using kvtd::c_api::put_error;

using kvtd::ipc::IpcErrc;
namespace proto = kvtd::proto;

int code_of(IpcErrc e) {
  switch (e) {
    case IpcErrc::kTimeout: return KVTD_E_TIMEOUT;
    case IpcErrc::kRingFull:
    case IpcErrc::kTooManyInFlight: return KVTD_E_RING_FULL;
    case IpcErrc::kNotReady: return KVTD_E_NOT_READY;
    case IpcErrc::kClosed: return KVTD_E_CLOSED;
    case IpcErrc::kWrongProcess: return KVTD_E_WRONG_PROCESS;
    case IpcErrc::kUnknownTask: return KVTD_E_UNKNOWN_TASK;
    case IpcErrc::kInUse: return KVTD_E_IN_USE;
    case IpcErrc::kTaskFailed: return KVTD_E_TASK_FAILED;
    case IpcErrc::kCacheCleared: return KVTD_E_CACHE_CLEARED;
    case IpcErrc::kSystem:
    case IpcErrc::kNoSpace:
    case IpcErrc::kPermission: return KVTD_E_SYSTEM;
    default: return KVTD_E_INVALID;
  }
}

template <typename S>
int report(const S& st, char* err, size_t len) {
  if (st.ok()) return KVTD_OK;
  put_error(err, len, st.error().message);
  return code_of(st.error().code);
}


void fill_completion(const kvtd::engine::TaskResult& r, kvtd_completion* out) {
  if (!out) return;
  out->task_id = r.task_id;
  out->status = static_cast<int32_t>(r.status);
  out->failed_rank = r.failures.empty() ? -1 : static_cast<int32_t>(r.failures.front().rank);
  out->blocks_done = r.blocks_done;
  out->blocks_skipped = r.blocks_skipped;
  out->latency_ns = r.complete_ns - r.submit_ns;
}

int finished(const kvtd::engine::TaskResult& r, kvtd_completion* out, char* err, size_t len) {
  fill_completion(r, out);
  if (r.ok()) return KVTD_OK;
  const auto& f = r.failures.front();
  put_error(err, len, "rank " + std::to_string(f.rank) + ": " + proto::task_status_name(f.status) + ": " + f.message);
  return KVTD_E_TASK_FAILED;
}

int submit_checked(kvtd::engine::EngineSession* s, const kvtd_task& t, uint64_t* task_id, char* err, size_t len,
                   const uint8_t* events = nullptr, size_t num_events = 0) {
  if (!s || !task_id) return invalid(err, len, "session and task_id must not be null");
  std::vector<std::string> keys;
  kvtd::engine::TaskRequest r;
  if (int rc = to_request(t, &keys, &r, err, len, s->groups().num_groups); rc != KVTD_OK) return rc;
  if (num_events != 0 && events == nullptr) return invalid(err, len, "engine events must not be null");
  using Event = std::array<std::uint8_t, proto::kEngineEventBytes>;
  r.engine_events = std::span<const Event>(reinterpret_cast<const Event*>(events), num_events);
  auto id = s->submit(r);
  if (!id.ok()) return report(id, err, len);
  *task_id = *id;
  return KVTD_OK;
}

}  // namespace

extern "C" {

int kvtd_client_abi(void) { return KVTD_CLIENT_ABI; }

const char* kvtd_status_name(int32_t status) {
  return proto::task_status_name(static_cast<proto::TaskStatus>(status));  // "unknown_status" for others
}

const char* kvtd_error_name(int code) {
  switch (code) {
    case KVTD_OK: return "ok";
    case KVTD_E_INVALID: return "invalid";
    case KVTD_E_TIMEOUT: return "timeout";
    case KVTD_E_RING_FULL: return "ring_full";
    case KVTD_E_NOT_READY: return "not_ready";
    case KVTD_E_UNKNOWN_TASK: return "unknown_task";
    case KVTD_E_IN_USE: return "in_use";
    case KVTD_E_SYSTEM: return "system";
    case KVTD_E_TASK_FAILED: return "task_failed";
    case KVTD_E_PENDING: return "pending";
    case KVTD_E_NO_EVENT: return "no_event";
    case KVTD_E_CLOSED: return "closed";
    case KVTD_E_WRONG_PROCESS: return "wrong_process";
    case KVTD_E_CACHE_CLEARED: return "cache_cleared";
    default: return "unknown_error";
  }
}

int64_t kvtd_now_ns(void) {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

namespace {

// `options` may be a caller's struct from before kv_identity (8 bytes): each field is read only
// where its flag says it is there, never the struct whole.
int create_session(const char* suffix, const kvtd_geometry* g, const kvtd_session_options* options,
                   kvtd_session** out, char* err, size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (!suffix || !g || !out) return invalid(err, err_len, "suffix, geometry and out must not be null");
    *out = nullptr;
    constexpr std::uint32_t known = KVTD_SESSION_ADOPT_HOST_TIER | KVTD_SESSION_ONLY_RANK |
                                    KVTD_SESSION_NO_COMPLETION_FORECAST | KVTD_SESSION_KV_IDENTITY;
    const std::uint32_t flags = options != nullptr ? options->flags : 0;
    if ((flags & ~known) != 0)
      return invalid(err, err_len, "unknown session option flags " + std::to_string(flags & ~known));
    kvtd::engine::SessionOptions o;
    o.suffix = suffix;
    o.adopt_host_tier = (flags & KVTD_SESSION_ADOPT_HOST_TIER) != 0;
    if (flags & KVTD_SESSION_ONLY_RANK) o.only_rank = options->only_rank;
    o.completion_forecast = (flags & KVTD_SESSION_NO_COMPLETION_FORECAST) == 0;
    if (flags & KVTD_SESSION_KV_IDENTITY) std::memcpy(&o.kv_identity, &options->kv_identity, sizeof o.kv_identity);
    std::memcpy(&o.geometry, g, sizeof o.geometry);  // same layout (static_assert above); validated by create
    auto s = kvtd::engine::EngineSession::create(o);
    if (!s.ok()) return report(s, err, err_len);
    *out = kvtd::c_api::adopt_session(std::move(s).value());
    return KVTD_OK;
  });
}

}  // namespace

int kvtd_session_create(const char* suffix, const kvtd_geometry* g, kvtd_session** out, char* err, size_t err_len) {
  return create_session(suffix, g, nullptr, out, err, err_len);
}

int kvtd_session_create_adopting(const char* suffix, const kvtd_geometry* g, kvtd_session** out, char* err,
                                 size_t err_len) {
  kvtd_session_options adopting{};
  adopting.flags = KVTD_SESSION_ADOPT_HOST_TIER;
  return create_session(suffix, g, &adopting, out, err, err_len);
}

int kvtd_session_create_with(const char* suffix, const kvtd_geometry* g, const kvtd_session_options* options,
                             kvtd_session** out, char* err, size_t err_len) {
  return create_session(suffix, g, options, out, err, err_len);
}

int kvtd_session_create_groups(const char* suffix, const kvtd_cache_groups* groups, kvtd_session** out, char* err,
                               size_t err_len) {
  return kvtd_session_create_groups_with(suffix, groups, nullptr, out, err, err_len);
}

int kvtd_session_create_groups_with(const char* suffix, const kvtd_cache_groups* groups,
                                    const kvtd_session_options* options, kvtd_session** out, char* err,
                                    size_t err_len) {
  return guarded(err, err_len, [&]() -> int {
    if (!suffix || !groups || !out) return invalid(err, err_len, "suffix, groups and out must not be null");
    *out = nullptr;
    const std::uint32_t flags = options ? options->flags : 0;
    // Adopting a host tier is defined for one geometry only (a kept pool is one shape's).
    constexpr std::uint32_t known =
        KVTD_SESSION_NO_COMPLETION_FORECAST | KVTD_SESSION_KV_IDENTITY | KVTD_SESSION_ONLY_RANK;
    if ((flags & ~known) != 0)
      return invalid(err, err_len,
                     "session option flags " + std::to_string(flags & ~known) +
                         " do not apply to a session over cache groups (only KVTD_SESSION_NO_COMPLETION_FORECAST, "
                         "KVTD_SESSION_KV_IDENTITY and KVTD_SESSION_ONLY_RANK do)");
    kvtd::engine::SessionOptions o;
    o.suffix = suffix;
    if (flags & KVTD_SESSION_ONLY_RANK) o.only_rank = options->only_rank;
    o.completion_forecast = (flags & KVTD_SESSION_NO_COMPLETION_FORECAST) == 0;
    if (flags & KVTD_SESSION_KV_IDENTITY) std::memcpy(&o.kv_identity, &options->kv_identity, sizeof o.kv_identity);
    std::memcpy(&o.groups, groups, sizeof o.groups);  // same layout (static_assert in c_api_geometry.cpp)
    if (o.groups.num_groups == 0) return invalid(err, err_len, "num_groups must be at least 1");
    auto s = kvtd::engine::EngineSession::create(o);
    if (!s.ok()) return report(s, err, err_len);
    *out = kvtd::c_api::adopt_session(std::move(s).value());
    return KVTD_OK;
  });
}

void kvtd_session_destroy(kvtd_session* s) {
  (void)guarded(nullptr, 0, [&]() -> int {
    if (s == nullptr) return KVTD_OK;
    bool was_live = false;
    // Wakes the calls waiting in it and returns once none is inside; a second destroy (another
    // thread's, or a repeated one) finds the handle gone and does nothing.
    auto session = kvtd::c_api::retire_session(s, &was_live);
    session.reset();  // unlinks the session and everything it made
    return KVTD_OK;
  });
}

int kvtd_session_geometry(kvtd_session* s, kvtd_geometry* out) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return KVTD_E_CLOSED;
  if (!s || !out) return KVTD_E_INVALID;
  std::memcpy(out, &use->geometry(), sizeof *out);
  return KVTD_OK;
}

int kvtd_register_tensor(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind, int32_t device_id,
                         const uint8_t handle[64], uint64_t offset, uint64_t bytes, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  return kvtd_register_tensor_on(s, rank, layer, kind, device_id, nullptr, handle, offset, bytes, err, err_len);
}

int kvtd_register_tensor_on(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind, int32_t device_id,
                            const char* pci_bus_id, const uint8_t handle[64], uint64_t offset, uint64_t bytes,
                            char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  return guarded(err, err_len, [&]() -> int {
    if (!s || !handle) return invalid(err, err_len, "session and handle must not be null");
    proto::TensorDesc d{};
    if (pci_bus_id != nullptr) {
      const auto packed = proto::parse_pci_bus_id(pci_bus_id);
      if (!packed)
        return invalid(err, err_len, "PCI bus id '" + std::string(pci_bus_id).substr(0, 32) +
                                         "' is not DDDD:BB:DD.F (hex; e.g. 0000:3b:00.0)");
      d.pci_bus_id = *packed;
    }
    d.rank = rank;
    d.layer = layer;
    d.kind = kind;
    d.device_id = device_id;
    d.dtype = use->geometry().dtype;
    d.offset = offset;
    d.bytes = bytes;
    std::memcpy(d.handle, handle, sizeof d.handle);
    return report(use->register_tensor(d), err, err_len);
  });
}

int kvtd_create_host_device_tensors(kvtd_session* s, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  if (!s) return invalid(err, err_len, "session must not be null");
  return guarded(err, err_len, [&]() -> int { return report(use->create_host_device_tensors(), err, err_len); });
}

void* kvtd_host_device_tensor(kvtd_session* s, uint32_t rank, uint32_t layer, uint32_t kind, uint64_t* bytes) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return nullptr;
  if (bytes) *bytes = 0;
  if (!s || kind >= proto::kTensorKinds) return nullptr;
  const auto k = static_cast<proto::TensorKind>(kind);
  std::byte* p = use->host_device_tensor(rank, layer, k);  // null outside the geometry; no-throw
  if (p && bytes) *bytes = proto::expected_tensor(use->geometry(), use->groups(), rank, layer, kind).bytes;
  return p;
}

int kvtd_publish(kvtd_session* s, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  if (!s) return invalid(err, err_len, "session must not be null");
  return guarded(err, err_len, [&]() -> int { return report(use->publish(), err, err_len); });
}

int kvtd_wait_ready(kvtd_session* s, int64_t timeout_ms, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  if (!s) return invalid(err, err_len, "session must not be null");
  return guarded(err, err_len,
                 [&]() -> int { return report(use->wait_ready(ms_to_ns(timeout_ms)), err, err_len); });
}

int kvtd_submit_task(kvtd_session* s, const kvtd_task* task, uint64_t* task_id, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  return guarded(err, err_len, [&]() -> int {
    if (!task) return invalid(err, err_len, "task must not be null");
    return submit_checked(use.live() ? &*use : nullptr, *task, task_id, err, err_len);
  });
}

int kvtd_submit_task_after_events(kvtd_session* s, const kvtd_task* task, const uint8_t* events, size_t num_events,
                                  uint64_t* task_id, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  static_assert(sizeof(std::array<std::uint8_t, proto::kEngineEventBytes>) == proto::kEngineEventBytes);
  return guarded(err, err_len, [&]() -> int {
    if (!task) return invalid(err, err_len, "task must not be null");
    return submit_checked(use.live() ? &*use : nullptr, *task, task_id, err, err_len, events, num_events);
  });
}

int kvtd_submit(kvtd_session* s, int kind, const int32_t* src, const int32_t* dst, size_t n, int64_t timeout_ms,
                uint64_t* task_id, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  return guarded(err, err_len, [&]() -> int {
    if (kind != KVTD_SWAP_TO_HOST && kind != KVTD_SWAP_TO_DEVICE)
      return invalid(err, err_len, "kvtd_submit is for swaps; use kvtd_submit_task or kvtd_submit_storage");
    kvtd_task t{};
    t.kind = kind;
    t.src = src;
    t.dst = dst;
    t.n = n;
    t.submit_timeout_ms = timeout_ms;
    return submit_checked(use.live() ? &*use : nullptr, t, task_id, err, err_len);
  });
}

int kvtd_submit_storage(kvtd_session* s, int kind, const char* const* keys, const int32_t* blocks, size_t n,
                        uint32_t flags, uint32_t min_hits, uint64_t cancel_task_id, int64_t timeout_ms,
                        uint64_t* task_id, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  return guarded(err, err_len, [&]() -> int {
    if (kind < KVTD_STORAGE_QUERY || kind > KVTD_CANCEL)
      return invalid(err, err_len, "kvtd_submit_storage is for storage tasks (KVTD_STORAGE_QUERY..KVTD_CANCEL)");
    if ((flags & ~uint32_t{KVTD_STORAGE_HOST_BLOCKS | KVTD_STORAGE_EVICT_BACKUP}) != 0)
      return invalid(err, err_len, "unknown storage flags " + std::to_string(flags));
    kvtd_task t{};
    t.kind = kind;
    t.flags = flags;
    t.keys = keys;
    t.blocks = blocks;
    t.num_keys = n;
    t.min_hits = min_hits;
    t.cancel_task_id = cancel_task_id;
    t.submit_timeout_ms = timeout_ms;
    return submit_checked(use.live() ? &*use : nullptr, t, task_id, err, err_len);
  });
}

int kvtd_clear_caches(kvtd_session* s, uint32_t flags, uint64_t weight_version, int64_t timeout_ms, char* err,
                      size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  if (!s) return invalid(err, err_len, "session must not be null");
  if (flags & ~static_cast<uint32_t>(KVTD_CLEAR_DROP_HOST_TIER | KVTD_CLEAR_SET_WEIGHT_VERSION))
    return invalid(err, err_len, "unknown clear flags " + std::to_string(flags));
  if (timeout_ms <= 0) return invalid(err, err_len, "timeout_ms must be positive");
  return guarded(err, err_len, [&]() -> int {
    kvtd::engine::ClearOptions o;
    o.drop_host_tier = (flags & KVTD_CLEAR_DROP_HOST_TIER) != 0;
    if (flags & KVTD_CLEAR_SET_WEIGHT_VERSION) o.weight_version = weight_version;
    o.timeout_ns = ms_to_ns(timeout_ms);
    return report(use->clear_caches(o), err, err_len);
  });
}

int kvtd_restore_caches(kvtd_session* s, int64_t timeout_ms, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  if (!s) return invalid(err, err_len, "session must not be null");
  if (timeout_ms <= 0) return invalid(err, err_len, "timeout_ms must be positive");
  return guarded(err, err_len, [&]() -> int { return report(use->restore_caches(ms_to_ns(timeout_ms)), err, err_len); });
}

int kvtd_cache_cleared(kvtd_session* s) {
  const kvtd::c_api::SessionUse use(s);
  return use.live() && use->cache_cleared() ? 1 : 0;
}

int kvtd_free_host_device_tensors(kvtd_session* s, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  if (!s) return invalid(err, err_len, "session must not be null");
  return guarded(err, err_len, [&]() -> int { return report(use->free_host_device_tensors(), err, err_len); });
}

int kvtd_set_weight_version(kvtd_session* s, uint64_t version) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return KVTD_E_CLOSED;
  if (!s) return KVTD_E_INVALID;
  return guarded(nullptr, 0, [&]() -> int {
    use->set_weight_version(version);
    return KVTD_OK;
  });
}

uint64_t kvtd_weight_version(kvtd_session* s) {
  const kvtd::c_api::SessionUse use(s);
  return use.live() ? use->weight_version() : 0;
}

const char* kvtd_session_name(kvtd_session* s) {
  const kvtd::c_api::SessionUse use(s);
  return use.live() ? use->name().c_str() : "";
}

uint64_t kvtd_session_generation(kvtd_session* s) {
  const kvtd::c_api::SessionUse use(s);
  return use.live() ? use->generation() : 0;
}

int kvtd_wait(kvtd_session* s, uint64_t task_id, int64_t timeout_ms, kvtd_completion* out, char* err,
              size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return 0;
  if (!s) return invalid(err, err_len, "session must not be null");
  return guarded(err, err_len, [&]() -> int {
    auto r = use->wait(task_id, ms_to_ns(timeout_ms));
    if (!r.ok()) return report(r, err, err_len);
    return finished(*r, out, err, err_len);
  });
}

int kvtd_poll(kvtd_session* s, uint64_t task_id, kvtd_completion* out, char* err, size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  if (!s) return invalid(err, err_len, "session must not be null");
  return guarded(err, err_len, [&]() -> int {
    auto r = use->poll(task_id);
    if (!r) {
      if (auto st = use->usable(); !st.ok()) return report(st, err, err_len);
      put_error(err, err_len, "task " + std::to_string(task_id) + " has not completed (or its result was taken)");
      return KVTD_E_PENDING;
    }
    return finished(*r, out, err, err_len);
  });
}

int kvtd_wait_layer(kvtd_session* s, uint64_t task_id, uint32_t layer, int64_t timeout_ms, int stage, char* err,
                    size_t err_len) {
  const kvtd::c_api::SessionUse use(s);
  if (s != nullptr && !use.live()) return closed(err, err_len);
  if (!s) return invalid(err, err_len, "session must not be null");
  return guarded(err, err_len, [&]() -> int {
    if (stage != KVTD_LAYER_DONE && stage != KVTD_LAYER_ENQUEUED)
      return invalid(err, err_len, "stage " + std::to_string(stage) + " is not KVTD_LAYER_DONE or KVTD_LAYER_ENQUEUED");
    const auto st = stage == KVTD_LAYER_DONE ? kvtd::engine::EngineSession::LayerStage::kDone
                                             : kvtd::engine::EngineSession::LayerStage::kEnqueued;
    return report(use->wait_layer(task_id, layer, ms_to_ns(timeout_ms), st), err, err_len);
  });
}

}  // extern "C"
