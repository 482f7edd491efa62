// kvtd/proto/cache_groups.h - a KV cache as a list of cache groups: the shape of the caches the
// models served today keep (hybrid sliding-window / full-attention, linear-attention or Mamba
// state beside attention, MLA with an indexer cache).
//
// A group is a set of layers whose caches share one kind, one block (or state-slot) shape and one
// pair of block counts. Each of its layers holds `num_tensors` device tensors, tensor t being
// [device_blocks, dims...] of `element_bytes` elements. A layer belongs to at most one group of
// the attention kinds (full attention, MLA latent, sliding window, state) and, beside it, to at
// most one indexer group (DeepSeek-V3.2 keeps an indexer key cache next to each MLA latent).
//
// The kinds follow the cache specs the engines declare (vLLM v1/kv_cache_interface.py:
// FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, MambaSpec; sglang's host pools
// PoolName KV / SWA / MAMBA / INDEXER, sglang/srt/mem_cache/hicache_storage.py:58). MLA is
// declared, never inferred from a missing value tensor.
//
// Storage keys name pages of `page_tokens` tokens of the prefix; every block group (all kinds but
// state) has that many tokens per block, so key i is block i of every block group.
//
// Plain fixed-width values, standard layout: safe in shared memory and to copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvtd/proto/checked.h"
#include "kvtd/proto/geometry.h"

namespace kvtd::proto {

inline constexpr std::uint32_t kMaxGroups = 8;
inline constexpr std::uint32_t kMaxGroupTensors = 4;
inline constexpr std::uint32_t kMaxGroupTensorDims = 3;
inline constexpr std::uint32_t kLayerWords = kMaxLayers / 64;

enum class GroupKind : std::uint32_t {
  kInvalid = 0,
  kFullAttention = 1,  // K/V (and fp8 scales) of every token: a prefix needs every block
  kMlaLatent = 2,      // one latent per token, the same bytes on every rank: one rank writes it
  kSlidingWindow = 3,  // K/V of the last window_tokens tokens: a prefix needs the blocks in the window
  kState = 4,          // per-request state slots (Mamba, linear attention): a prefix needs its end's state
  kIndexer = 5,        // sparse-attention indexer keys beside a latent: a prefix needs every block
};
inline constexpr std::uint32_t kLastGroupKind = 5;

constexpr const char* group_kind_name(GroupKind k) {
  switch (k) {
    case GroupKind::kFullAttention: return "full_attention";
    case GroupKind::kMlaLatent: return "mla_latent";
    case GroupKind::kSlidingWindow: return "sliding_window";
    case GroupKind::kState: return "state";
    case GroupKind::kIndexer: return "indexer";
    default: return "invalid";
  }
}

// The kind named `name` (group_kind_name's words), kInvalid for any other.
inline GroupKind group_kind_from_name(std::string_view name) {
  for (std::uint32_t k = 1; k <= kLastGroupKind; ++k)
    if (name == group_kind_name(static_cast<GroupKind>(k))) return static_cast<GroupKind>(k);
  return GroupKind::kInvalid;
}

// Whether a kind's layers may also belong to an indexer group (the indexer is the sidecar).
constexpr bool is_attention_kind(GroupKind k) { return k != GroupKind::kIndexer && k != GroupKind::kInvalid; }

// One tensor of a group's layer, per block: [dims[0], ..., dims[ndim-1]] of element_bytes.
struct GroupTensor {
  std::uint32_t element_bytes;  // 1, 2 or 4
  std::uint32_t ndim;           // 1..kMaxGroupTensorDims
  std::int64_t dims[kMaxGroupTensorDims];
};
static_assert(std::is_standard_layout_v<GroupTensor> && sizeof(GroupTensor) == 32);

struct CacheGroup {
  std::uint32_t kind;           // GroupKind
  std::uint32_t num_tensors;    // tensors per layer, 1..kMaxGroupTensors
  std::uint32_t block_tokens;   // tokens per block (page_tokens); 0 for a state group: one slot per request
  std::uint32_t window_tokens;  // sliding window: the tokens a position attends back to; 0 otherwise
  std::int64_t device_blocks;   // blocks (state slots) of each device tensor
  std::uint32_t host_blocks;    // host pool blocks (slots) of this group per rank
  std::uint32_t reserved;       // 0
  std::uint64_t layers[kLayerWords];  // bit l of word l/64: layer l has this group's tensors
  GroupTensor tensors[kMaxGroupTensors];

  constexpr GroupKind group_kind() const { return static_cast<GroupKind>(kind); }
  constexpr bool has_layer(std::uint32_t l) const { return l < kMaxLayers && (layers[l / 64] >> (l % 64)) & 1u; }
  constexpr void add_layer(std::uint32_t l) { layers[l / 64] |= std::uint64_t{1} << (l % 64); }
  constexpr std::uint32_t num_layers() const {
    std::uint32_t n = 0;
    for (std::uint64_t w : layers)
      for (; w != 0; w &= w - 1) ++n;
    return n;
  }
  // An MLA latent's bytes are the same on every rank: rank 0's copy serves all. (An indexer beside
  // one is too: group_replicated below, which needs the other groups.)
  constexpr bool replicated() const { return group_kind() == GroupKind::kMlaLatent; }
};
static_assert(std::is_standard_layout_v<CacheGroup> && std::is_trivially_copyable_v<CacheGroup>);
static_assert(sizeof(CacheGroup) == 32 + 8 * kLayerWords + 32 * kMaxGroupTensors);

struct CacheGroups {
  std::uint32_t num_ranks;
  std::uint32_t num_groups;   // 1..kMaxGroups
  std::uint32_t page_tokens;  // tokens per storage key: every block group's block_tokens
  std::uint32_t reserved;     // 0
  CacheGroup groups[kMaxGroups];
};
static_assert(std::is_standard_layout_v<CacheGroups> && std::is_trivially_copyable_v<CacheGroups>);

// Whether group `g`'s bytes are the same on every rank, so rank 0 stores it once for every TP
// size: an MLA latent, and an indexer whose every layer's attention group is an MLA latent (the
// DeepSeek-V3.2 indexer keys: sglang backs them up from TP rank 0 only under MLA,
// managers/cache_controller.py:485-490 with hybrid_cache/hybrid_cache_controller.py:698-718,
// where only Mamba state and Mooncake's MHA drafts are sharded).
constexpr bool group_replicated(const CacheGroups& gs, std::uint32_t g) {
  const CacheGroup& c = gs.groups[g];
  if (c.replicated()) return true;
  if (c.group_kind() != GroupKind::kIndexer) return false;
  for (std::uint32_t l = 0; l < kMaxLayers; ++l) {
    if (!c.has_layer(l)) continue;
    for (std::uint32_t h = 0; h < gs.num_groups && h < kMaxGroups; ++h) {
      const CacheGroup& a = gs.groups[h];
      if (h != g && is_attention_kind(a.group_kind()) && a.has_layer(l) && !a.replicated()) return false;
    }
  }
  return true;
}

// Sizes a group list implies, in checked 64-bit arithmetic (each below kMaxSizeBytes).
struct GroupSizes {
  const char* problem = nullptr;                     // null when every size fits
  std::uint64_t block_bytes[kMaxGroups] = {};        // one block (slot) of a group, every layer and tensor
  std::uint64_t host_pool_bytes[kMaxGroups] = {};    // block_bytes x host_blocks
  std::uint64_t host_pool_total = 0;                 // every group's host pool
  std::uint64_t device_tensor_bytes = 0;             // the largest single device tensor
};

constexpr GroupSizes group_sizes(const CacheGroups& gs) {
  GroupSizes out;
  for (std::uint32_t g = 0; g < gs.num_groups && g < kMaxGroups; ++g) {
    const CacheGroup& c = gs.groups[g];
    std::uint64_t per_layer = 0;
    for (std::uint32_t t = 0; t < c.num_tensors && t < kMaxGroupTensors; ++t) {
      std::uint64_t b = c.tensors[t].element_bytes, whole = 0;
      for (std::uint32_t d = 0; d < c.tensors[t].ndim && d < kMaxGroupTensorDims; ++d)
        if (!checked_mul(b, static_cast<std::uint64_t>(c.tensors[t].dims[d]), &b) || b >= kMaxSizeBytes) {
          out.problem = "bytes per block of a group tensor overflow";
          return out;
        }
      if (!checked_mul(b, static_cast<std::uint64_t>(c.device_blocks), &whole) || whole >= kMaxSizeBytes) {
        out.problem = "bytes per device tensor (blocks x bytes per block) of a group overflow";
        return out;
      }
      if (whole > out.device_tensor_bytes) out.device_tensor_bytes = whole;
      if (!checked_add(per_layer, b, &per_layer)) {
        out.problem = "bytes per block of a group's layer overflow";
        return out;
      }
    }
    if (!checked_mul(per_layer, c.num_layers(), &out.block_bytes[g]) || out.block_bytes[g] >= kMaxSizeBytes ||
        !checked_mul(out.block_bytes[g], c.host_blocks, &out.host_pool_bytes[g]) ||
        out.host_pool_bytes[g] >= kMaxSizeBytes ||
        !checked_add(out.host_pool_total, out.host_pool_bytes[g], &out.host_pool_total) ||
        out.host_pool_total >= kMaxSizeBytes) {
      out.problem = "host pool bytes of the groups (host blocks x bytes per block, every layer) overflow";
      return out;
    }
  }
  return out;
}

// The group list of a single-shape geometry: its layers as one group, full attention or, when
// the caller declares `mla`, an MLA latent (key tensor only). Extra (MTP) layers, which have
// their own device block count, form a second group of the same kind; the host blocks are given
// to the main group (the extra layers share the host pool's blocks today).
constexpr CacheGroups groups_of(const CacheGeometry& g, bool mla) {
  CacheGroups out{};
  out.num_ranks = g.num_ranks;
  out.page_tokens = static_cast<std::uint32_t>(g.key_shape[2]);
  out.num_groups = g.num_extra_layers != 0 ? 2 : 1;
  for (std::uint32_t i = 0; i < out.num_groups; ++i) {
    CacheGroup& c = out.groups[i];
    c.kind = static_cast<std::uint32_t>(mla ? GroupKind::kMlaLatent : GroupKind::kFullAttention);
    c.block_tokens = out.page_tokens;
    c.device_blocks = i == 0 ? g.key_shape[0] : g.extra_device_blocks;
    c.host_blocks = i == 0 ? g.num_host_blocks : 0;
    for (const auto kind : {TensorKind::kKey, TensorKind::kValue, TensorKind::kKeyScale, TensorKind::kValueScale}) {
      if (!g.has_tensor(kind)) continue;
      const bool scale = kind == TensorKind::kKeyScale || kind == TensorKind::kValueScale;
      const std::int64_t* s = kind == TensorKind::kKey || kind == TensorKind::kKeyScale ? g.key_shape : g.value_shape;
      GroupTensor& t = c.tensors[c.num_tensors++];
      t.element_bytes = scale ? g.scale_element_bytes() : dtype_bytes(g.cache_dtype());
      t.ndim = scale ? 2 : 3;
      for (std::uint32_t d = 0; d < t.ndim; ++d) t.dims[d] = s[1 + d];
    }
  }
  const std::uint32_t main_layers = g.num_layers - g.num_extra_layers;
  for (std::uint32_t l = 0; l < g.num_layers && l < kMaxLayers; ++l) out.groups[l < main_layers ? 0 : 1].add_layer(l);
  return out;
}

namespace detail {

inline std::string group_tensor_problem(const GroupTensor& t) {
  if (t.element_bytes != 1 && t.element_bytes != 2 && t.element_bytes != 4)
    return "element bytes " + std::to_string(t.element_bytes) + " must be 1, 2 or 4";
  if (t.ndim < 1 || t.ndim > kMaxGroupTensorDims)
    return "ndim " + std::to_string(t.ndim) + " must be in [1, " + std::to_string(kMaxGroupTensorDims) + "]";
  for (std::uint32_t d = 0; d < kMaxGroupTensorDims; ++d) {
    if (d < t.ndim && t.dims[d] <= 0) return "dimension " + std::to_string(d) + " must be positive";
    if (d >= t.ndim && t.dims[d] != 0) return "dimension " + std::to_string(d) + " is past ndim and must be 0";
  }
  return "";
}

inline std::string group_problem(const CacheGroup& c, std::uint32_t page_tokens) {
  const GroupKind kind = c.group_kind();
  if (kind == GroupKind::kInvalid || c.kind > kLastGroupKind) return "kind " + std::to_string(c.kind) + " is not a group kind";
  if (c.num_tensors < 1 || c.num_tensors > kMaxGroupTensors)
    return "num_tensors " + std::to_string(c.num_tensors) + " must be in [1, " + std::to_string(kMaxGroupTensors) + "]";
  for (std::uint32_t t = 0; t < kMaxGroupTensors; ++t) {
    const GroupTensor& x = c.tensors[t];
    if (t >= c.num_tensors) {
      if (x.element_bytes != 0 || x.ndim != 0 || x.dims[0] != 0 || x.dims[1] != 0 || x.dims[2] != 0)
        return "tensor " + std::to_string(t) + " is past num_tensors and must be all zero";
    } else if (auto why = group_tensor_problem(x); !why.empty()) {
      return "tensor " + std::to_string(t) + ": " + why;
    }
  }
  if (kind == GroupKind::kState && c.block_tokens != 0)
    return "a state group holds one slot per request: block_tokens must be 0, not " + std::to_string(c.block_tokens);
  if (kind != GroupKind::kState && c.block_tokens != page_tokens)
    return "block_tokens " + std::to_string(c.block_tokens) + " must equal page_tokens " + std::to_string(page_tokens) +
           " (storage keys name pages of every block group)";
  if (kind == GroupKind::kSlidingWindow && c.window_tokens == 0) return "a sliding-window group needs window_tokens > 0";
  if (kind != GroupKind::kSlidingWindow && c.window_tokens != 0) return "window_tokens is for sliding-window groups only";
  if (c.device_blocks <= 0 || c.device_blocks > INT32_MAX)
    return "device_blocks " + std::to_string(c.device_blocks) + " must be in [1, 2^31)";
  if (c.host_blocks > INT32_MAX) return "host_blocks must be < 2^31";
  if (c.reserved != 0) return "reserved must be 0";
  if (c.num_layers() == 0) return "it has no layers";
  return "";
}

// The highest layer of any group plus one (0 without layers).
constexpr std::uint32_t layer_count(const CacheGroups& gs) {
  std::uint32_t n = 0;
  for (std::uint32_t g = 0; g < gs.num_groups && g < kMaxGroups; ++g)
    for (std::uint32_t l = 0; l < kMaxLayers; ++l)
      if (gs.groups[g].has_layer(l) && l + 1 > n) n = l + 1;
  return n;
}

inline std::string layers_problem(const CacheGroups& gs) {
  const std::uint32_t layers = layer_count(gs);
  for (std::uint32_t l = 0; l < layers; ++l) {
    int attention = -1, indexer = -1;
    for (std::uint32_t g = 0; g < gs.num_groups; ++g) {
      if (!gs.groups[g].has_layer(l)) continue;
      int& slot = is_attention_kind(gs.groups[g].group_kind()) ? attention : indexer;
      if (slot >= 0)
        return "layer " + std::to_string(l) + " is in groups " + std::to_string(slot) + " and " + std::to_string(g) +
               " (at most one attention group and one indexer group per layer)";
      slot = static_cast<int>(g);
    }
    if (attention < 0) return "layer " + std::to_string(l) + " is in no attention group (layers must be 0..n-1)";
    const std::uint32_t tensors =
        gs.groups[attention].num_tensors + (indexer >= 0 ? gs.groups[indexer].num_tensors : 0u);
    if (tensors > kTensorKinds)
      return "layer " + std::to_string(l) + " has " + std::to_string(tensors) + " tensors across its groups, at most " +
             std::to_string(kTensorKinds) + " (a session registers 4 per layer)";
    const GroupKind beside = gs.groups[attention].group_kind();
    if (indexer >= 0 && beside != GroupKind::kMlaLatent && beside != GroupKind::kFullAttention)
      return "layer " + std::to_string(l) + ": an indexer group sits beside MLA or full attention, not " +
             group_kind_name(beside);
  }
  return "";
}

}  // namespace detail

// The one validation of a group list (geometry.h's geometry_problem, grown to groups): "" when
// every field is in range, the layers are 0..n-1, each in exactly one attention group and at
// most one indexer group, and every size fits; else the first problem in words, naming the
// group.
inline std::string geometry_problem(const CacheGroups& gs) {
  if (gs.num_ranks < 1 || gs.num_ranks > kMaxRanks)
    return "num_ranks " + std::to_string(gs.num_ranks) + " must be in [1, " + std::to_string(kMaxRanks) + "]";
  if (gs.num_groups < 1 || gs.num_groups > kMaxGroups)
    return "num_groups " + std::to_string(gs.num_groups) + " must be in [1, " + std::to_string(kMaxGroups) + "]";
  if (gs.page_tokens == 0) return "page_tokens must be positive";
  if (gs.reserved != 0) return "reserved must be 0";
  for (std::uint32_t g = 0; g < kMaxGroups; ++g) {
    if (g >= gs.num_groups) {
      if (gs.groups[g].kind != 0 || gs.groups[g].num_layers() != 0)
        return "group " + std::to_string(g) + " is past num_groups and must be empty";
      continue;
    }
    if (auto why = detail::group_problem(gs.groups[g], gs.page_tokens); !why.empty())
      return "group " + std::to_string(g) + " (" + group_kind_name(gs.groups[g].group_kind()) + "): " + why;
  }
  if (auto why = detail::layers_problem(gs); !why.empty()) return why;
  std::int64_t device_total = 0, host_total = 0;
  for (std::uint32_t g = 0; g < gs.num_groups; ++g) {
    device_total += gs.groups[g].device_blocks;  // each < 2^31, at most 8: no overflow
    host_total += gs.groups[g].host_blocks;
  }
  if (device_total > INT32_MAX)
    return "the groups' device blocks together (" + std::to_string(device_total) +
           ") must be < 2^31: a task names them in one id space";
  if (host_total > INT32_MAX)
    return "the groups' host blocks together (" + std::to_string(host_total) + ") must be < 2^31";
  if (const auto s = group_sizes(gs); s.problem != nullptr) return s.problem;
  return "";
}

}  // namespace kvtd::proto
