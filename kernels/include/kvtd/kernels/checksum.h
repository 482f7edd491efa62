// kvtd/kernels/checksum.h - the block checksum of --verify-swaps, on the host and on the device.
//
// checksum(block) = sum over j of word_j * (2j + 1), mod 2^64, where word_j is the block's j-th
// 8-byte little-endian word (the last one zero-padded). Any single flipped bit changes it (the
// multiplier is odd), as does moving a word to another place unless the two are equal; it is a
// guard against corruption, not against an adversary. Order-free across threads (a sum), so
// the device computes it in parallel with one atomic add per thread.
//
// Thread-safety: stateless; the launcher is asynchronous on its stream.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvtd/kernels/layout.h"

namespace kvtd::kernels {

// The checksum of `bytes` bytes at `p` (host memory).
std::uint64_t block_checksum(const std::byte* p, std::uint64_t bytes);

// Device (CUDA builds only): out[t * count + i] = checksum of block ids[i] of tensor t, for every
// t < num_tensors and i < count. `d_tensors`, `d_ids` and `d_out` are device-accessible; `d_out`
// is overwritten. Returns the cudaError_t of the launches as int (0 = success).
int launch_block_checksums(const LayerTensor* d_tensors, std::uint32_t num_tensors, const std::int32_t* d_ids,
                           std::int64_t count, std::uint64_t* d_out, void* stream);

}  // namespace kvtd::kernels
