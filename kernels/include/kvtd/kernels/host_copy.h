// kvtd/kernels/host_copy.h - carry out a CopyPlan with memcpy (the host backend's executor).
//
// The CUDA backend carries out the very same plans on the GPU; tests compare its bytes with
// these. A CopyTarget is one tensor of one layer: base addresses of the source and destination
// tensors, the bytes of one block (identical on both sides) and each side's stride: the bytes
// from one block to the next. A packed layer-first tensor has stride == block_bytes; a
// page-first host pool (every layer of one block contiguous) has stride == the bytes of one
// block across all layers, so the layout transform happens in the copy itself.
//
// Thread-safety: stateless; callers must not run two plans that write the same blocks at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "kvtd/kernels/copy_plan.h"

namespace kvtd::kernels {

struct CopyTarget {
  const std::byte* src;
  std::byte* dst;
  std::uint64_t block_bytes;
  std::uint64_t src_stride;  // >= block_bytes
  std::uint64_t dst_stride;  // >= block_bytes
};

// A target whose both sides are packed (stride == block_bytes).
constexpr CopyTarget packed_target(const std::byte* src, std::byte* dst, std::uint64_t block_bytes) {
  return CopyTarget{src, dst, block_bytes, block_bytes, block_bytes};
}

// Copies every pair of `plan` for one tensor.
void copy_blocks_host(const CopyPlan& plan, const CopyTarget& target) noexcept;

// Copies every pair for each target, in order. `targets` is typically layers x tensors.
void copy_all_host(const CopyPlan& plan, std::span<const CopyTarget> targets) noexcept;

// Layer by layer: `targets_per_layer` consecutive targets form one layer; after each layer
// `on_layer_done(layer)` is called (the engine waits on this progress for compute overlap).
void copy_layerwise_host(const CopyPlan& plan, std::span<const CopyTarget> targets,
                         std::size_t targets_per_layer,
                         const std::function<void(std::uint32_t layer)>& on_layer_done);

}  // namespace kvtd::kernels
