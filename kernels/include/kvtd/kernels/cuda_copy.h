// kvtd/kernels/cuda_copy.h - host-callable launchers of the CUDA copy kernels.
//
// CUDA types stay out of this header: streams are passed as void* (cudaStream_t), results as
// the int value of cudaError_t (0 = success), so files that include it need no CUDA headers.
// Only linked in builds with the CUDA toolkit (KVTD_HAVE_CUDA).
//
// Every kernel copies each block as `pieces` equal parts (cut at 16-byte multiples), one warp per
// part: 16-byte vector accesses when both addresses and the size are 16-byte aligned, else
// 8-byte, else bytes; streaming (non-temporal) loads and stores so a swap does not evict the
// model's working set from L2. Pointers may be device memory or mapped pinned host memory.
// pieces_for() picks the count for a fixed part size, pieces_to_fill() for a launch too small to
// keep the link busy with whole blocks (a 64 KiB block as one warp is a long serial chain of PCIe
// round trips).
//
// Thread-safety: launches are asynchronous on the given stream; callers synchronise.
#pragma once

#include <cstdint>

#include "kvtd/kernels/host_copy.h"
#include "kvtd/kernels/layout.h"

namespace kvtd::kernels {

// One tensor: block src_ids[i] of target.src -> block dst_ids[i] of target.dst, i < count.
// `d_src_ids` / `d_dst_ids` are device-accessible arrays.
int launch_scattered_copy(const CopyTarget& target, const std::int32_t* d_src_ids, const std::int32_t* d_dst_ids,
                          std::int64_t count, void* stream, std::uint32_t pieces = 1);

// Every tensor in one launch: `d_targets` is a device-accessible table of `num_targets` targets
// (the layers' base pointers), the ids are shared by all of them. With `d_sums` (device memory of
// num_targets * count words, zeroed by the caller before the launch) the same pass adds the
// checksum (checksum.h) of the bytes it copied for pair i of target t into d_sums[t * count + i].
int launch_scattered_copy_all(const CopyTarget* d_targets, std::uint32_t num_targets, const std::int32_t* d_src_ids,
                              const std::int32_t* d_dst_ids, std::int64_t count, void* stream, std::uint32_t pieces = 1,
                              std::uint64_t* d_sums = nullptr);

// Layout transform, same layout as gather_to_staging_host / scatter_from_staging_host.
// `d_tensors` is a device-accessible table; `d_offsets[t]` is the byte offset of tensor t inside
// one staged object (a prefix sum of block_bytes); `object_bytes` the size of one object.
// `d_ids` may be nullptr for one object (count 1): its block is `only_id`, passed by value, so a
// per-object transform uploads nothing (cudaErrorInvalidValue for nullptr with another count).
int launch_gather_to_staging(const LayerTensor* d_tensors, const std::uint64_t* d_offsets, std::uint32_t num_tensors,
                             const std::int32_t* d_ids, std::int64_t count, std::byte* staging,
                             std::uint64_t object_bytes, void* stream, std::uint32_t pieces = 1,
                             std::int32_t only_id = 0);
int launch_scatter_from_staging(const LayerTensor* d_tensors, const std::uint64_t* d_offsets,
                                std::uint32_t num_tensors, const std::int32_t* d_ids, std::int64_t count,
                                const std::byte* staging, std::uint64_t object_bytes, void* stream,
                                std::uint32_t pieces = 1, std::int32_t only_id = 0);

// Parts per block for blocks of at most `max_block_bytes`: one part per `piece_bytes` (0: whole
// blocks), at least 1, at most 64.
constexpr std::uint32_t pieces_for(std::uint64_t max_block_bytes, std::uint64_t piece_bytes) {
  if (piece_bytes == 0 || max_block_bytes <= piece_bytes) return 1;
  const std::uint64_t n = (max_block_bytes + piece_bytes - 1) / piece_bytes;
  return n > 64 ? 64u : static_cast<std::uint32_t>(n);
}

// The smallest part pieces_to_fill cuts: below it a warp's four 16-byte loads per lane (2 KiB)
// are most of the part.
inline constexpr std::uint64_t kMinFillPartBytes = 4096;

// Parts per block for a launch that has `warps` warps with whole blocks: 1 when that reaches
// `target_warps`, else as many as reach it, each part at least kMinFillPartBytes, at most 64. A
// small launch (one block of 64 tensors: 64 warps, each a chain of PCIe round trips over 32 KiB)
// otherwise leaves most of the GPU, and of the link, idle.
constexpr std::uint32_t pieces_to_fill(std::uint64_t max_block_bytes, std::uint64_t warps, std::uint64_t target_warps) {
  if (warps == 0 || warps >= target_warps) return 1;
  const std::uint64_t want = (target_warps + warps - 1) / warps;
  const std::uint64_t fit = max_block_bytes / kMinFillPartBytes;
  const std::uint64_t n = want < fit ? want : fit;
  return n <= 1 ? 1u : n > 64 ? 64u : static_cast<std::uint32_t>(n);
}

}  // namespace kvtd::kernels
