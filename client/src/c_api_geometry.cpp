// The C ABI's geometry rules and version (kvtd/kvtd_client.h): asked of the library by the
// Python module instead of re-derived there.
#include <cstddef>
#include <cstring>
#include <string>

#include "c_api_support.h"
#include "kvtd/base/version.h"
#include "kvtd/kvtd_client.h"
#include "kvtd/proto/cache_groups.h"
#include "kvtd/proto/group_spec.h"
#include "kvtd/proto/group_hits.h"
#include "kvtd/proto/session.h"

namespace proto = kvtd::proto;

using kvtd::c_api::guarded;
using kvtd::c_api::invalid;

// kvtd_cache_groups is proto::CacheGroups, field for field.
static_assert(sizeof(kvtd_group_tensor) == sizeof(proto::GroupTensor));
static_assert(sizeof(kvtd_cache_group) == sizeof(proto::CacheGroup));
static_assert(sizeof(kvtd_cache_groups) == sizeof(proto::CacheGroups));
static_assert(offsetof(kvtd_cache_group, layers) == offsetof(proto::CacheGroup, layers));
static_assert(offsetof(kvtd_cache_group, tensors) == offsetof(proto::CacheGroup, tensors));
static_assert(offsetof(kvtd_cache_groups, groups) == offsetof(proto::CacheGroups, groups));
static_assert(KVTD_MAX_GROUPS == proto::kMaxGroups);
static_assert(sizeof(kvtd_kv_identity) == sizeof(proto::KvIdentity));
static_assert(offsetof(kvtd_kv_identity, pp_rank) == offsetof(proto::KvIdentity, pp_rank));
static_assert(offsetof(kvtd_kv_identity, cp_size) == offsetof(proto::KvIdentity, cp_size));
static_assert(KVTD_KV_LAYOUT_REPLICATED == static_cast<int>(proto::KvLayout::kReplicated));
static_assert(KVTD_KV_LAYOUT_PER_RANK == static_cast<int>(proto::KvLayout::kPerRank));
static_assert(KVTD_GROUP_INDEXER == static_cast<int>(proto::GroupKind::kIndexer));
static_assert(KVTD_GROUP_SLIDING_WINDOW == static_cast<int>(proto::GroupKind::kSlidingWindow));

namespace {

// A private copy of the caller's groups, validated: "" or the problem.
std::string copy_groups(const kvtd_cache_groups* in, proto::CacheGroups* out) {
  std::memcpy(out, in, sizeof *out);
  return proto::geometry_problem(*out);
}

}  // namespace

extern "C" {

const char* kvtd_version(void) { return kvtd::kVersion; }

int kvtd_geometry_check(const kvtd_geometry* g, char* err, size_t err_len) {
  if (!g) return invalid(err, err_len, "null geometry");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGeometry pg{};
    std::memcpy(&pg, g, sizeof pg);  // same layout (static_asserts above)
    if (auto why = proto::geometry_problem(pg); !why.empty()) return invalid(err, err_len, why);
    return KVTD_OK;
  });
}

int kvtd_tensor_shape(const kvtd_geometry* g, uint32_t layer, uint32_t kind, int64_t shape[4], uint32_t* ndim,
                      uint64_t* block_bytes, uint64_t* bytes, char* err, size_t err_len) {
  if (!g) return invalid(err, err_len, "null geometry");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGeometry pg{};
    std::memcpy(&pg, g, sizeof pg);
    if (auto why = proto::geometry_problem(pg); !why.empty()) return invalid(err, err_len, why);
    if (layer >= pg.num_layers)
      return invalid(err, err_len, "layer " + std::to_string(layer) + " is outside [0, " + std::to_string(pg.num_layers) + ")");
    if (kind >= proto::kTensorKinds) return invalid(err, err_len, "tensor kind " + std::to_string(kind) + " is not 0..3");
    const auto k = static_cast<proto::TensorKind>(kind);
    const bool present = pg.has_tensor(k);
    const proto::TensorDesc d = present ? proto::describe_tensor(pg, 0, layer, k) : proto::TensorDesc{};
    if (shape)
      for (int i = 0; i < 4; ++i) shape[i] = i < static_cast<int>(d.ndim) ? d.shape[i] : 0;
    if (ndim) *ndim = d.ndim;
    if (block_bytes) *block_bytes = present ? pg.block_bytes(k) : 0;
    if (bytes) *bytes = d.bytes;
    return KVTD_OK;
  });
}

int kvtd_groups_check(const kvtd_cache_groups* groups, char* err, size_t err_len) {
  if (!groups) return invalid(err, err_len, "null cache groups");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGroups gs{};
    if (auto why = copy_groups(groups, &gs); !why.empty()) return invalid(err, err_len, why);
    return KVTD_OK;
  });
}

int kvtd_group_spec(const kvtd_cache_groups* groups, uint32_t group, char* out, size_t out_len, char* err,
                    size_t err_len) {
  if (!groups || !out) return invalid(err, err_len, "null cache groups or output");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGroups gs{};
    if (auto why = copy_groups(groups, &gs); !why.empty()) return invalid(err, err_len, why);
    if (group >= gs.num_groups)
      return invalid(err, err_len, "group " + std::to_string(group) + " of " + std::to_string(gs.num_groups));
    const std::string text = proto::format_group_spec(gs.groups[group]);
    if (text.size() + 1 > out_len)
      return invalid(err, err_len, "the spec needs " + std::to_string(text.size() + 1) + " bytes, the buffer has " +
                                       std::to_string(out_len));
    std::memcpy(out, text.c_str(), text.size() + 1);
    return KVTD_OK;
  });
}

int kvtd_groups_of_geometry(const kvtd_geometry* g, int mla, kvtd_cache_groups* out, char* err, size_t err_len) {
  if (!g || !out) return invalid(err, err_len, "null geometry or output");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGeometry pg{};
    std::memcpy(&pg, g, sizeof pg);
    if (auto why = proto::geometry_problem(pg); !why.empty()) return invalid(err, err_len, why);
    if (mla != 0 && pg.has_value())
      return invalid(err, err_len, "an MLA latent has no value cache, and this geometry has one");
    const proto::CacheGroups gs = proto::groups_of(pg, mla != 0);
    std::memcpy(out, &gs, sizeof gs);
    return KVTD_OK;
  });
}

int kvtd_group_sizes(const kvtd_cache_groups* groups, uint64_t block_bytes[KVTD_MAX_GROUPS],
                     uint64_t host_pool_bytes[KVTD_MAX_GROUPS], char* err, size_t err_len) {
  if (!groups) return invalid(err, err_len, "null cache groups");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGroups gs{};
    if (auto why = copy_groups(groups, &gs); !why.empty()) return invalid(err, err_len, why);
    const proto::GroupSizes sizes = proto::group_sizes(gs);
    for (std::uint32_t g = 0; g < proto::kMaxGroups; ++g) {
      if (block_bytes) block_bytes[g] = sizes.block_bytes[g];
      if (host_pool_bytes) host_pool_bytes[g] = sizes.host_pool_bytes[g];
    }
    return KVTD_OK;
  });
}

int kvtd_group_hits(const kvtd_cache_groups* groups, uint32_t num_keys, const uint8_t* present, uint32_t* pages,
                    uint32_t group_pages[KVTD_MAX_GROUPS], char* err, size_t err_len) {
  if (!groups || !pages || (num_keys != 0 && !present)) return invalid(err, err_len, "null cache groups, pages or present");
  return guarded(err, err_len, [&]() -> int {
    proto::CacheGroups gs{};
    if (auto why = copy_groups(groups, &gs); !why.empty()) return invalid(err, err_len, why);
    if (num_keys > proto::kMaxKeysPerTask)
      return invalid(err, err_len, "num_keys " + std::to_string(num_keys) + " is above " +
                                       std::to_string(proto::kMaxKeysPerTask) + " (keys per task)");
    const auto hits = proto::loadable_prefix(gs, num_keys, [&](std::uint32_t g, std::uint32_t k) {
      return present[std::size_t{g} * num_keys + k] != 0;
    });
    *pages = hits.pages;
    if (group_pages)
      for (std::uint32_t g = 0; g < proto::kMaxGroups; ++g) group_pages[g] = hits.group_pages[g];
    return KVTD_OK;
  });
}

}  // extern "C"
