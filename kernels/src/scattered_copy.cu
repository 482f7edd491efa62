#include <cuda_runtime.h>

#include "kvtd/kernels/cuda_copy.h"

namespace kvtd::kernels {
namespace {

constexpr int kWarpsPerCta = 8;

template <typename Vec>
__global__ void scattered_copy_kernel(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                      std::uint64_t block_bytes, const std::int32_t* __restrict__ src_ids,
                                      const std::int32_t* __restrict__ dst_ids, std::int64_t count) {
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  const unsigned lane = threadIdx.x % 32;
  if (warp >= count) return;
  const auto* s = reinterpret_cast<const Vec*>(src + static_cast<std::uint64_t>(src_ids[warp]) * block_bytes);
  auto* d = reinterpret_cast<Vec*>(dst + static_cast<std::uint64_t>(dst_ids[warp]) * block_bytes);
  const std::uint64_t n = block_bytes / sizeof(Vec);
  for (std::uint64_t i = lane; i < n; i += 32) __stcs(d + i, __ldcs(s + i));
}

__global__ void scattered_copy_bytes(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                     std::uint64_t block_bytes, const std::int32_t* __restrict__ src_ids,
                                     const std::int32_t* __restrict__ dst_ids, std::int64_t count) {
  const std::int64_t warp = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
  const unsigned lane = threadIdx.x % 32;
  if (warp >= count) return;
  const unsigned char* s = src + static_cast<std::uint64_t>(src_ids[warp]) * block_bytes;
  unsigned char* d = dst + static_cast<std::uint64_t>(dst_ids[warp]) * block_bytes;
  for (std::uint64_t i = lane; i < block_bytes; i += 32) d[i] = s[i];
}

bool aligned(const void* p, std::uint64_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

}  // namespace

int launch_scattered_copy(const CopyTarget& t, const std::int32_t* d_src_ids, const std::int32_t* d_dst_ids,
                          std::int64_t count, void* stream) {
  if (count <= 0 || t.block_bytes == 0) return 0;
  const auto ctas = static_cast<unsigned>((count + kWarpsPerCta - 1) / kWarpsPerCta);
  auto* st = static_cast<cudaStream_t>(stream);
  const auto* src = reinterpret_cast<const unsigned char*>(t.src);
  auto* dst = reinterpret_cast<unsigned char*>(t.dst);
  if (t.block_bytes % 16 == 0 && aligned(src, 16) && aligned(dst, 16)) {
    scattered_copy_kernel<int4><<<ctas, kWarpsPerCta * 32, 0, st>>>(src, dst, t.block_bytes, d_src_ids, d_dst_ids, count);
  } else if (t.block_bytes % 8 == 0 && aligned(src, 8) && aligned(dst, 8)) {
    scattered_copy_kernel<long long><<<ctas, kWarpsPerCta * 32, 0, st>>>(src, dst, t.block_bytes, d_src_ids, d_dst_ids, count);
  } else {
    scattered_copy_bytes<<<ctas, kWarpsPerCta * 32, 0, st>>>(src, dst, t.block_bytes, d_src_ids, d_dst_ids, count);
  }
  return static_cast<int>(cudaGetLastError());
}

const char* cuda_error_text(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace kvtd::kernels
