// A kvtd_task from a C caller, checked and translated (c_api_task.h); and the compile-time proof
// that the C header mirrors the internal enums and structs it is cast or copied to.
#include "c_api_task.h"

#include <algorithm>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "c_api_support.h"
#include "kvtd/proto/task.h"

namespace kvtd::c_api {
namespace {

namespace proto = kvtd::proto;

static_assert(sizeof(kvtd_geometry) == sizeof(proto::CacheGeometry), "kvtd_geometry mirrors proto::CacheGeometry");
// The C header's constants are the internal enums' values (the C ABI passes them through with a
// cast); a renumbering on either side fails here, not as a wrong kind on the wire.
#define KVTD_SAME(c, e) static_assert(static_cast<long long>(c) == static_cast<long long>(e), #c " != " #e)
KVTD_SAME(KVTD_SWAP_TO_HOST, proto::TaskKind::kSwapToHost);
KVTD_SAME(KVTD_SWAP_TO_DEVICE, proto::TaskKind::kSwapToDevice);
KVTD_SAME(KVTD_STORAGE_QUERY, proto::TaskKind::kStorageQuery);
KVTD_SAME(KVTD_STORAGE_READ, proto::TaskKind::kStorageRead);
KVTD_SAME(KVTD_STORAGE_WRITE, proto::TaskKind::kStorageWrite);
KVTD_SAME(KVTD_PREFETCH, proto::TaskKind::kPrefetch);
KVTD_SAME(KVTD_CANCEL, proto::TaskKind::kCancel);
KVTD_SAME(KVTD_DTYPE_BFLOAT16, proto::CacheDtype::kBFloat16);
KVTD_SAME(KVTD_DTYPE_FLOAT16, proto::CacheDtype::kFloat16);
KVTD_SAME(KVTD_DTYPE_UINT8, proto::CacheDtype::kUInt8);
KVTD_SAME(KVTD_DTYPE_BLOCK_WISE_FP8, proto::CacheDtype::kBlockWiseFp8);
KVTD_SAME(KVTD_KEY, proto::TensorKind::kKey);
KVTD_SAME(KVTD_VALUE, proto::TensorKind::kValue);
KVTD_SAME(KVTD_KEY_SCALE, proto::TensorKind::kKeyScale);
KVTD_SAME(KVTD_VALUE_SCALE, proto::TensorKind::kValueScale);
KVTD_SAME(KVTD_READY_CACHE, proto::kReadyCacheAttached);
KVTD_SAME(KVTD_READY_HOST_POOL, proto::kReadyHostPool);
KVTD_SAME(KVTD_READY_HOST_TIER_TAKEN_OVER, proto::kReadyHostTierTakenOver);
#undef KVTD_SAME
// kvtd_geometry is copied into proto::CacheGeometry with memcpy: every field at the same offset.
#define KVTD_SAME_FIELD(f) static_assert(offsetof(kvtd_geometry, f) == offsetof(proto::CacheGeometry, f), #f)
KVTD_SAME_FIELD(num_ranks);
KVTD_SAME_FIELD(num_layers);
KVTD_SAME_FIELD(dtype);
KVTD_SAME_FIELD(num_host_blocks);
KVTD_SAME_FIELD(key_shape);
KVTD_SAME_FIELD(value_shape);
KVTD_SAME_FIELD(scale_bytes);
KVTD_SAME_FIELD(num_extra_layers);
KVTD_SAME_FIELD(extra_device_blocks);
#undef KVTD_SAME_FIELD
static_assert(sizeof(kvtd_task) == 96, "kvtd_task is part of the ABI");
static_assert(sizeof(kvtd_completion) == 40, "kvtd_completion is part of the ABI");

}  // namespace

int to_request(const kvtd_task& t, std::vector<std::string>* keys, kvtd::engine::TaskRequest* r, char* err, size_t len,
               std::uint32_t groups) {
  if (t.kind < 1 || t.kind > static_cast<int32_t>(proto::kMaxTaskKind))
    return invalid(err, len, "task kind " + std::to_string(t.kind) + " is not one of KVTD_SWAP_TO_HOST..KVTD_CANCEL");
  constexpr uint32_t kKnown = KVTD_STORAGE_HOST_BLOCKS | KVTD_STORAGE_EVICT_BACKUP | KVTD_TASK_LAYERWISE;
  if ((t.flags & ~kKnown) != 0) return invalid(err, len, "unknown task flags " + std::to_string(t.flags & ~kKnown));
  if (t.reserved != 0) return invalid(err, len, "kvtd_task.reserved must be 0");
  if (t.n > 0 && (!t.src || !t.dst)) return invalid(err, len, "src and dst must not be null when n > 0");
  const auto kind = static_cast<proto::TaskKind>(t.kind);
  const bool swap = kind == proto::TaskKind::kSwapToHost || kind == proto::TaskKind::kSwapToDevice;
  if (!swap && t.n > 0) return invalid(err, len, "src/dst are for swaps; storage tasks use keys and blocks");
  if (t.num_keys > proto::kMaxKeysPerTask)
    return invalid(err, len, std::to_string(t.num_keys) + " keys exceed the limit of " + std::to_string(proto::kMaxKeysPerTask));
  if (t.num_keys > 0 && !t.keys) return invalid(err, len, "keys must not be null when num_keys > 0");
  const bool needs_blocks = !swap && kind != proto::TaskKind::kStorageQuery && kind != proto::TaskKind::kCancel;
  if (t.num_keys > 0 && needs_blocks && !t.blocks)
    return invalid(err, len, "blocks must not be null for this storage task");
  if ((t.flags & KVTD_TASK_LAYERWISE) != 0 && kind != proto::TaskKind::kSwapToDevice)
    return invalid(err, len, "KVTD_TASK_LAYERWISE is for KVTD_SWAP_TO_DEVICE only");
  if (t.deadline_ns < 0) return invalid(err, len, "deadline_ns must be 0 (none) or a CLOCK_MONOTONIC time");
  // A group session's storage task names a block per key and group (-1: the group has none).
  const size_t num_blocks = needs_blocks ? t.num_keys * std::max<std::uint32_t>(groups, 1) : 0;
  // A negative id is what a caller's id of 2^31 or more becomes in an int32: refused here, naming
  // it, rather than sent on as another block.
  for (const auto& [ids, count, what] : {std::tuple{t.src, t.n, "src"}, std::tuple{t.dst, t.n, "dst"},
                                        std::tuple{t.blocks, num_blocks, "blocks"}})
    for (size_t i = 0; ids != nullptr && i < count; ++i)
      if (ids[i] < 0 && !(groups != 0 && ids == t.blocks && ids[i] == -1))
        return invalid(err, len, std::string(what) + "[" + std::to_string(i) + "] is " + std::to_string(ids[i]) +
                                     ": block ids are 0..2147483647 (a larger id wrapped in a 32-bit field?)");
  keys->reserve(t.num_keys);
  for (size_t i = 0; i < t.num_keys; ++i) {
    if (!t.keys[i]) return invalid(err, len, "key " + std::to_string(i) + " is null");
    keys->emplace_back(t.keys[i], strnlen(t.keys[i], proto::kMaxKeyBytes + 1));  // too long: refused by submit
  }
  r->kind = kind;
  r->src = {t.src, t.n};
  r->dst = {t.dst, t.n};
  r->keys = *keys;
  if (needs_blocks && t.num_keys > 0) r->blocks = {t.blocks, num_blocks};
  r->host_blocks = (t.flags & KVTD_STORAGE_HOST_BLOCKS) != 0;
  r->evict_backup = (t.flags & KVTD_STORAGE_EVICT_BACKUP) != 0;
  r->layerwise = (t.flags & KVTD_TASK_LAYERWISE) != 0;
  r->min_hits = t.min_hits;
  r->cancel_task_id = t.cancel_task_id;
  r->after_task_id = t.after_task_id;
  r->deadline_ns = t.deadline_ns;
  r->submit_timeout_ns = ms_to_ns(t.submit_timeout_ms);
  return KVTD_OK;
}

}  // namespace kvtd::c_api
