// kvtd/proto/geometry.h - the KV cache geometry shared by the engine and every rank daemon.
//
// A cache tensor is layer-first and paged: per layer, key and value are
// [num_blocks, kv_heads, block_size, head_dim] of `dtype` (a 3-D cache [num_blocks, kv_heads,
// block_size] is the same bytes with head_dim 1); block_wise_fp8 adds key and value scale
// tensors [num_blocks, kv_heads, block_size] whose elements are the engine's default dtype
// (2 bytes for float16/bfloat16, 4 for float32). Models without a separate value cache (MLA)
// have an all-zero value shape.
//
// Extra layers (MTP / speculative decoding) are the last `num_extra_layers` of `num_layers`:
// the same per-block shape, their own device block count. Host blocks are shared by all layers.
//
// Plain fixed-width values, standard layout: safe to place in shared memory and to copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kvtd/proto/checked.h"

namespace kvtd::proto {

inline constexpr std::uint32_t kMaxRanks = 16;
inline constexpr std::uint32_t kMaxLayers = 512;
inline constexpr std::uint32_t kTensorKinds = 4;
inline constexpr std::size_t kHandleBytes = 64;
inline constexpr std::uint32_t kDefaultScaleBytes = 2;

enum class CacheDtype : std::uint32_t {
  kInvalid = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kUInt8 = 3,
  kBlockWiseFp8 = 4,  // 1-byte elements plus per-token scale tensors
};

enum class TensorKind : std::uint32_t { kKey = 0, kValue = 1, kKeyScale = 2, kValueScale = 3 };

constexpr std::uint32_t dtype_bytes(CacheDtype d) {
  switch (d) {
    case CacheDtype::kBFloat16:
    case CacheDtype::kFloat16: return 2;
    case CacheDtype::kUInt8:
    case CacheDtype::kBlockWiseFp8: return 1;
    default: return 0;
  }
}

constexpr const char* dtype_name(CacheDtype d) {
  switch (d) {
    case CacheDtype::kBFloat16: return "bfloat16";
    case CacheDtype::kFloat16: return "float16";
    case CacheDtype::kUInt8: return "uint8";
    case CacheDtype::kBlockWiseFp8: return "block_wise_fp8";
    default: return "invalid";
  }
}

constexpr const char* tensor_kind_name(TensorKind k) {
  switch (k) {
    case TensorKind::kKey: return "key";
    case TensorKind::kValue: return "value";
    case TensorKind::kKeyScale: return "key_scale";
    case TensorKind::kValueScale: return "value_scale";
  }
  return "?";
}

struct CacheGeometry {
  std::uint32_t num_ranks;
  std::uint32_t num_layers;       // every layer with a KV cache, extra layers included
  std::uint32_t dtype;            // CacheDtype
  std::uint32_t num_host_blocks;  // host pool blocks per rank
  std::int64_t key_shape[4];      // device blocks (main layers), kv heads, block size, head dim
  std::int64_t value_shape[4];    // all zero when there is no value cache
  std::uint32_t scale_bytes;      // fp8 scale element bytes: 2 or 4 (0 = 2)
  std::uint32_t num_extra_layers; // the last num_extra_layers layers are extra (MTP) layers
  std::int64_t extra_device_blocks;  // device blocks of each extra layer (0 without extra layers)

  constexpr CacheDtype cache_dtype() const { return static_cast<CacheDtype>(dtype); }
  // Device blocks of the main layers.
  constexpr std::int64_t num_device_blocks() const { return key_shape[0]; }
  constexpr bool is_extra_layer(std::uint32_t layer) const { return layer + num_extra_layers >= num_layers; }
  // Device blocks of layer `layer` (its tensors hold this many blocks).
  constexpr std::int64_t device_blocks(std::uint32_t layer) const {
    return num_extra_layers != 0 && is_extra_layer(layer) ? extra_device_blocks : key_shape[0];
  }
  // Device block ids a task touching every layer may use: valid in every layer.
  constexpr std::int64_t usable_device_blocks() const {
    return num_extra_layers != 0 && extra_device_blocks < key_shape[0] ? extra_device_blocks : key_shape[0];
  }
  constexpr std::uint32_t scale_element_bytes() const { return scale_bytes == 0 ? kDefaultScaleBytes : scale_bytes; }
  constexpr bool has_value() const { return value_shape[0] != 0; }
  constexpr bool has_scales() const { return cache_dtype() == CacheDtype::kBlockWiseFp8; }

  constexpr bool has_tensor(TensorKind k) const {
    switch (k) {
      case TensorKind::kKey: return true;
      case TensorKind::kValue: return has_value();
      case TensorKind::kKeyScale: return has_scales();
      case TensorKind::kValueScale: return has_scales() && has_value();
    }
    return false;
  }

  // Bytes of one block of one layer of tensor `k`; 0 if the tensor does not exist.
  constexpr std::uint64_t block_bytes(TensorKind k) const {
    if (!has_tensor(k)) return 0;
    const std::int64_t* s = (k == TensorKind::kKey || k == TensorKind::kKeyScale) ? key_shape
                                                                                  : value_shape;
    const auto tokens = static_cast<std::uint64_t>(s[1]) * static_cast<std::uint64_t>(s[2]);
    if (k == TensorKind::kKeyScale || k == TensorKind::kValueScale) return tokens * scale_element_bytes();
    return tokens * static_cast<std::uint64_t>(s[3]) * dtype_bytes(cache_dtype());
  }

  // Bytes of one block across every layer and tensor: what one swapped block moves per rank.
  constexpr std::uint64_t bytes_per_block_all_layers() const {
    std::uint64_t sum = 0;
    for (std::uint32_t k = 0; k < kTensorKinds; ++k) sum += block_bytes(static_cast<TensorKind>(k));
    return sum * num_layers;
  }
};
// Sizes a geometry implies, computed with overflow checks. `problem` is null when every size
// fits (each below kMaxSizeBytes), else names the first that does not.
inline constexpr std::uint64_t kMaxSizeBytes = 1ull << 56;  // 64 PiB: far above any real cache

struct GeometrySizes {
  const char* problem = nullptr;
  std::uint64_t block_bytes_all_layers = 0;  // one block, every layer and tensor
  std::uint64_t device_tensor_bytes = 0;     // largest single device tensor
  std::uint64_t host_pool_bytes = 0;         // block_bytes_all_layers * num_host_blocks (unpadded)
};

constexpr GeometrySizes geometry_sizes(const CacheGeometry& g) {
  GeometrySizes out;
  std::uint64_t per_layer = 0;
  for (std::uint32_t k = 0; k < kTensorKinds; ++k) {
    const auto kind = static_cast<TensorKind>(k);
    if (!g.has_tensor(kind)) continue;
    const std::int64_t* s = (kind == TensorKind::kKey || kind == TensorKind::kKeyScale) ? g.key_shape : g.value_shape;
    for (int i = 0; i < 4; ++i)
      if (s[i] <= 0) {
        out.problem = "a cache shape dimension is not positive";
        return out;
      }
    const std::uint64_t elem = (kind == TensorKind::kKeyScale || kind == TensorKind::kValueScale)
                                   ? g.scale_element_bytes()
                                   : dtype_bytes(g.cache_dtype());
    std::uint64_t b = 0, t = 0;
    const bool scale = kind == TensorKind::kKeyScale || kind == TensorKind::kValueScale;
    if (!checked_mul(static_cast<std::uint64_t>(s[1]), static_cast<std::uint64_t>(s[2]), &b) ||
        (!scale && !checked_mul(b, static_cast<std::uint64_t>(s[3]), &b)) || !checked_mul(b, elem, &b) ||
        b >= kMaxSizeBytes) {
      out.problem = "bytes per block (kv_heads x block_size x head_dim x element size) overflow";
      return out;
    }
    const std::int64_t blocks = g.num_extra_layers != 0 && g.extra_device_blocks > s[0] ? g.extra_device_blocks : s[0];
    if (!checked_mul(b, static_cast<std::uint64_t>(blocks), &t) || t >= kMaxSizeBytes) {
      out.problem = "bytes per device tensor (blocks x bytes per block) overflow";
      return out;
    }
    if (t > out.device_tensor_bytes) out.device_tensor_bytes = t;
    if (!checked_add(per_layer, b, &per_layer)) {
      out.problem = "bytes per block overflow";
      return out;
    }
  }
  if (!checked_mul(per_layer, g.num_layers, &out.block_bytes_all_layers) || out.block_bytes_all_layers >= kMaxSizeBytes) {
    out.problem = "bytes per block across all layers overflow";
    return out;
  }
  if (!checked_mul(out.block_bytes_all_layers, g.num_host_blocks, &out.host_pool_bytes) ||
      out.host_pool_bytes >= kMaxSizeBytes) {
    out.problem = "host pool bytes (host blocks x bytes per block across all layers) overflow";
    return out;
  }
  return out;
}

static_assert(std::is_standard_layout_v<CacheGeometry>);
static_assert(std::is_trivially_copyable_v<CacheGeometry>);
static_assert(sizeof(CacheGeometry) == 96);
static_assert(offsetof(CacheGeometry, scale_bytes) == 80);

// The one validation of a geometry, used by the engine's library (create, the C ABI, the Python
// module through it), the daemon's flags and the daemon's check of a published header: "" when
// every field is in range and every size it implies fits 64 bits with room to spare, else the
// first problem in words.
inline std::string geometry_problem(const CacheGeometry& g) {
  if (g.num_ranks < 1 || g.num_ranks > kMaxRanks)
    return "num_ranks " + std::to_string(g.num_ranks) + " must be in [1, " + std::to_string(kMaxRanks) + "]";
  if (g.num_layers < 1 || g.num_layers > kMaxLayers)
    return "num_layers " + std::to_string(g.num_layers) + " must be in [1, " + std::to_string(kMaxLayers) + "]";
  if (dtype_bytes(g.cache_dtype()) == 0) return "dtype " + std::to_string(g.dtype) + " is not a known cache dtype";
  for (int i = 0; i < 4; ++i)
    if (g.key_shape[i] <= 0) return "key shape dimension " + std::to_string(i) + " must be positive";
  if (g.key_shape[0] > INT32_MAX) return "device block count must be < 2^31";
  if (g.value_shape[0] != 0) {
    for (int i = 0; i < 4; ++i)
      if (g.value_shape[i] <= 0) return "value shape dimension " + std::to_string(i) + " must be positive";
    if (g.value_shape[0] != g.key_shape[0]) return "value and key shapes must have the same block count";
  } else {
    for (int i = 0; i < 4; ++i)
      if (g.value_shape[i] != 0) return "value shape must be all zero or all positive";
  }
  if (g.num_host_blocks > INT32_MAX) return "host block count must be < 2^31";
  if (g.scale_bytes != 0 && g.scale_bytes != 2 && g.scale_bytes != 4)
    return "scale element bytes " + std::to_string(g.scale_bytes) + " must be 2 or 4 (0 = 2)";
  if (g.num_extra_layers >= g.num_layers)
    return "num_extra_layers " + std::to_string(g.num_extra_layers) + " must be below num_layers " +
           std::to_string(g.num_layers) + " (which counts the extra layers too)";
  if (g.num_extra_layers == 0 && g.extra_device_blocks != 0)
    return "extra_device_blocks must be 0 without extra layers";
  if (g.num_extra_layers != 0 && (g.extra_device_blocks <= 0 || g.extra_device_blocks > INT32_MAX))
    return "extra_device_blocks " + std::to_string(g.extra_device_blocks) + " must be in [1, 2^31)";
  if (const auto s = geometry_sizes(g); s.problem != nullptr) return s.problem;
  return "";
}

// Every tensor the geometry has, as (layer, kind): layer by layer, key, value, key scale, value
// scale (the registry's order). `for (auto [layer, kind] : tensors_of(g))` replaces the nested
// layer x kind loops with their has_tensor checks; early returns work as in any loop.
struct TensorSlot {
  std::uint32_t layer;
  TensorKind kind;
};

class TensorRange {
 public:
  class iterator {
   public:
    constexpr iterator(const CacheGeometry* g, std::uint32_t i) : g_(g), i_(i) { skip(); }
    constexpr TensorSlot operator*() const { return {i_ / kTensorKinds, static_cast<TensorKind>(i_ % kTensorKinds)}; }
    constexpr iterator& operator++() {
      ++i_;
      skip();
      return *this;
    }
    constexpr bool operator!=(const iterator& o) const { return i_ != o.i_; }

   private:
    constexpr void skip() {
      while (i_ < g_->num_layers * kTensorKinds && !g_->has_tensor(static_cast<TensorKind>(i_ % kTensorKinds))) ++i_;
    }
    const CacheGeometry* g_;
    std::uint32_t i_;
  };
  constexpr explicit TensorRange(const CacheGeometry& g) : g_(&g) {}
  constexpr iterator begin() const { return {g_, 0}; }
  constexpr iterator end() const { return {g_, g_->num_layers * kTensorKinds}; }

 private:
  const CacheGeometry* g_;  // borrowed: the range must not outlive the geometry
};

constexpr TensorRange tensors_of(const CacheGeometry& g) { return TensorRange(g); }

// Calls f(layer, kind) for every tensor of tensors_of(g).
template <typename F>
constexpr void for_each_tensor(const CacheGeometry& g, F&& f) {
  for (const auto [layer, kind] : tensors_of(g)) f(layer, kind);
}

}  // namespace kvtd::proto
