// The device side of kvtd/kernels/checksum.h: one warp per (tensor, block), each lane summing a
// strided share of the block's words as the copy kernels read them (warp_pass.h: 16-byte loads,
// four in flight), one atomic add per lane into the block's total.
#include <cuda_runtime.h>

#include "kvtd/kernels/checksum.h"
#include "launch.h"
#include "warp_pass.h"

namespace kvtd::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void zero_sums(unsigned long long* out, std::int64_t n) {
  const std::int64_t k = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (k < n) __stcs(out + k, 0ull);
}

__global__ void block_sums(const LayerTensor* __restrict__ tensors, std::uint32_t num_tensors,
                           const std::int32_t* __restrict__ ids, std::int64_t count, unsigned long long* out) {
  const std::int64_t w = static_cast<std::int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (w >= count * num_tensors) return;
  const LayerTensor t = tensors[w / count];
  const auto* p = reinterpret_cast<const unsigned char*>(t.base) + static_cast<std::uint64_t>(ids[w % count]) * t.stride;
  atomicAdd(out + w, warp_pass</*kStore=*/false, /*kSum=*/true>(nullptr, p, t.block_bytes, threadIdx.x % 32, 0));
}

}  // namespace

int launch_block_checksums(const LayerTensor* d_tensors, std::uint32_t num_tensors, const std::int32_t* d_ids,
                           std::int64_t count, std::uint64_t* d_out, void* stream) {
  if (count <= 0 || num_tensors == 0) return 0;
  auto* out = reinterpret_cast<unsigned long long*>(d_out);
  const std::int64_t n = count * num_tensors;
  const auto s = static_cast<cudaStream_t>(stream);
  KVTD_LAUNCH(zero_sums, static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, s, out, n);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  KVTD_LAUNCH(block_sums, static_cast<unsigned>((n + kThreads / 32 - 1) / (kThreads / 32)), kThreads, s, d_tensors,
              num_tensors, d_ids, count, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace kvtd::kernels
