// kvtd/kernels/layout.h - layer-first cache blocks <-> block-first staging (the storage layout).
//
// The device cache is layer-first: per layer and tensor, [blocks, heads, block_size, head_dim].
// A stored object is one block of one rank holding every layer's key, value and scales
// contiguously. The staging buffer holds `ids.size()` such objects back to back:
//
//   staging[i] = for each tensor t in `tensors` order (layer-major: L0 K, L0 V, L0 Ks, L0 Vs, L1 K...):
//                  block ids[i] of tensor t (tensors[t].block_bytes bytes)
//
// The CUDA kernels in cuda_copy.h implement the same layout; tests compare the two byte for byte.
// Thread-safety: stateless.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvtd::kernels {

struct LayerTensor {
  std::byte* base;            // first block of this layer's tensor
  std::uint64_t block_bytes;  // bytes of one block
  std::uint64_t stride;       // bytes from one block to the next (block_bytes when packed)
};

// Bytes of one block-first object: the sum of every tensor's block bytes.
std::uint64_t staging_object_bytes(std::span<const LayerTensor> tensors);

// Copies blocks `ids` of every tensor into `staging` (ids.size() objects).
void gather_to_staging_host(std::span<const LayerTensor> tensors, std::span<const std::int32_t> ids,
                            std::byte* staging);

// The inverse: copies each staged object into block ids[i] of every tensor.
void scatter_from_staging_host(std::span<const LayerTensor> tensors, std::span<const std::int32_t> ids,
                               const std::byte* staging);

}  // namespace kvtd::kernels
