#include <cuda_runtime.h>

#include "kvtd/kernels/cuda_copy.h"
#include "launch.h"
#include "warp_pass.h"

namespace kvtd::kernels {
namespace {

constexpr int kWarpsPerCta = 8;
constexpr int kThreads = kWarpsPerCta * 32;

__device__ __forceinline__ std::int64_t global_warp() {
  return static_cast<std::int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
}

// Part `p` of `pieces` of a block of `bytes`: [*begin, *begin + *len), cuts at 16-byte multiples
// so every part but the last keeps the block's alignment.
__device__ __forceinline__ void piece_of(std::uint64_t bytes, std::uint32_t pieces, std::uint32_t p,
                                         std::uint64_t* begin, std::uint64_t* len) {
  const std::uint64_t per = ((bytes + pieces - 1) / pieces + 15) / 16 * 16;
  const std::uint64_t b = static_cast<std::uint64_t>(p) * per;
  *begin = b < bytes ? b : bytes;
  *len = (b + per < bytes ? b + per : bytes) - *begin;
}

// Copies part `p` of one block; with kSum returns this lane's share of the part's checksum.
template <bool kSum = false>
__device__ __forceinline__ unsigned long long copy_piece(unsigned char* d, const unsigned char* s,
                                                         std::uint64_t bytes, std::uint32_t pieces, std::uint32_t p) {
  std::uint64_t begin = 0, len = 0;
  piece_of(bytes, pieces, p, &begin, &len);
  return len == 0 ? 0 : warp_pass</*kStore=*/true, kSum>(d + begin, s + begin, len, threadIdx.x % 32, begin);
}

// Warp w handles part (w % pieces) of block (w / pieces).
__global__ void scattered_one(CopyTarget t, const std::int32_t* __restrict__ src_ids,
                              const std::int32_t* __restrict__ dst_ids, std::int64_t count, std::uint32_t pieces) {
  const std::int64_t w = global_warp();
  if (w >= count * pieces) return;
  const std::int64_t i = w / pieces;
  copy_piece(reinterpret_cast<unsigned char*>(t.dst) + static_cast<std::uint64_t>(dst_ids[i]) * t.dst_stride,
             reinterpret_cast<const unsigned char*>(t.src) + static_cast<std::uint64_t>(src_ids[i]) * t.src_stride,
             t.block_bytes, pieces, static_cast<std::uint32_t>(w % pieces));
}

// Warp w handles part (w % pieces) of block (w / pieces % count) of target (w / pieces / count):
// the parts of one block in neighbouring warps, so a CTA's accesses stay contiguous. With kSum
// each lane adds its share of the checksum into sums[w / pieces] (target * count + pair), which
// the caller zeroed.
template <bool kSum>
__global__ void scattered_all(const CopyTarget* __restrict__ targets, std::uint32_t num_targets,
                              const std::int32_t* __restrict__ src_ids, const std::int32_t* __restrict__ dst_ids,
                              std::int64_t count, std::uint32_t pieces, unsigned long long* sums) {
  const std::int64_t w = global_warp();
  if (w >= count * num_targets * pieces) return;
  const std::int64_t block = w / pieces;
  const CopyTarget t = targets[block / count];
  const std::int64_t i = block % count;
  const unsigned long long sum = copy_piece<kSum>(
      reinterpret_cast<unsigned char*>(t.dst) + static_cast<std::uint64_t>(dst_ids[i]) * t.dst_stride,
      reinterpret_cast<const unsigned char*>(t.src) + static_cast<std::uint64_t>(src_ids[i]) * t.src_stride,
      t.block_bytes, pieces, static_cast<std::uint32_t>(w % pieces));
  if constexpr (kSum) atomicAdd(sums + block, sum);
}

// Warp w handles part (w % pieces) of staged object (w / pieces / num_tensors), tensor
// (w / pieces % num_tensors). No `ids` (one object): its block is `only_id`.
template <bool kGather>
__global__ void staging_transform(const LayerTensor* __restrict__ tensors, const std::uint64_t* __restrict__ offsets,
                                  std::uint32_t num_tensors, const std::int32_t* __restrict__ ids, std::int32_t only_id,
                                  std::int64_t count, unsigned char* staging, std::uint64_t object_bytes,
                                  std::uint32_t pieces) {
  const std::int64_t w = global_warp();
  if (w >= count * num_tensors * pieces) return;
  const std::int64_t part = w / pieces;
  const std::int64_t i = part / num_tensors;
  const auto t = static_cast<std::uint32_t>(part % num_tensors);
  const LayerTensor lt = tensors[t];
  const std::int32_t id = ids != nullptr ? ids[i] : only_id;
  unsigned char* block = reinterpret_cast<unsigned char*>(lt.base) + static_cast<std::uint64_t>(id) * lt.stride;
  unsigned char* object = staging + static_cast<std::uint64_t>(i) * object_bytes + offsets[t];
  const auto p = static_cast<std::uint32_t>(w % pieces);
  if (kGather) {
    copy_piece(object, block, lt.block_bytes, pieces, p);
  } else {
    copy_piece(block, object, lt.block_bytes, pieces, p);
  }
}

unsigned ctas_for(std::int64_t warps) { return static_cast<unsigned>((warps + kWarpsPerCta - 1) / kWarpsPerCta); }

}  // namespace

int launch_scattered_copy(const CopyTarget& t, const std::int32_t* d_src_ids, const std::int32_t* d_dst_ids,
                          std::int64_t count, void* stream, std::uint32_t pieces) {
  if (count <= 0 || t.block_bytes == 0) return 0;
  if (pieces == 0) pieces = 1;
  KVTD_LAUNCH(scattered_one, ctas_for(count * pieces), kThreads, static_cast<cudaStream_t>(stream), t, d_src_ids,
              d_dst_ids, count, pieces);
  return static_cast<int>(cudaGetLastError());
}

int launch_scattered_copy_all(const CopyTarget* d_targets, std::uint32_t num_targets, const std::int32_t* d_src_ids,
                              const std::int32_t* d_dst_ids, std::int64_t count, void* stream, std::uint32_t pieces,
                              std::uint64_t* d_sums) {
  if (count <= 0 || num_targets == 0) return 0;
  if (pieces == 0) pieces = 1;
  const unsigned ctas = ctas_for(count * num_targets * pieces);
  const auto s = static_cast<cudaStream_t>(stream);
  if (d_sums != nullptr) {
    KVTD_LAUNCH(scattered_all<true>, ctas, kThreads, s, d_targets, num_targets, d_src_ids, d_dst_ids, count, pieces,
                reinterpret_cast<unsigned long long*>(d_sums));
  } else {
    KVTD_LAUNCH(scattered_all<false>, ctas, kThreads, s, d_targets, num_targets, d_src_ids, d_dst_ids, count, pieces,
                static_cast<unsigned long long*>(nullptr));
  }
  return static_cast<int>(cudaGetLastError());
}

int launch_gather_to_staging(const LayerTensor* d_tensors, const std::uint64_t* d_offsets, std::uint32_t num_tensors,
                             const std::int32_t* d_ids, std::int64_t count, std::byte* staging,
                             std::uint64_t object_bytes, void* stream, std::uint32_t pieces, std::int32_t only_id) {
  if (count <= 0 || num_tensors == 0) return 0;
  if (d_ids == nullptr && count != 1) return static_cast<int>(cudaErrorInvalidValue);  // only_id names one
  if (pieces == 0) pieces = 1;
  KVTD_LAUNCH(staging_transform<true>, ctas_for(count * num_tensors * pieces), kThreads,
              static_cast<cudaStream_t>(stream), d_tensors, d_offsets, num_tensors, d_ids, only_id, count,
              reinterpret_cast<unsigned char*>(staging), object_bytes, pieces);
  return static_cast<int>(cudaGetLastError());
}

int launch_scatter_from_staging(const LayerTensor* d_tensors, const std::uint64_t* d_offsets,
                                std::uint32_t num_tensors, const std::int32_t* d_ids, std::int64_t count,
                                const std::byte* staging, std::uint64_t object_bytes, void* stream,
                                std::uint32_t pieces, std::int32_t only_id) {
  if (count <= 0 || num_tensors == 0) return 0;
  if (d_ids == nullptr && count != 1) return static_cast<int>(cudaErrorInvalidValue);  // only_id names one
  if (pieces == 0) pieces = 1;
  KVTD_LAUNCH(staging_transform<false>, ctas_for(count * num_tensors * pieces), kThreads,
              static_cast<cudaStream_t>(stream), d_tensors, d_offsets, num_tensors, d_ids, only_id, count,
              const_cast<unsigned char*>(reinterpret_cast<const unsigned char*>(staging)), object_bytes, pieces);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvtd::kernels
