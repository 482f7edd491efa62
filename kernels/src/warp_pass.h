// warp_pass.h (kernels-internal) - how one warp reads a stretch of a block: the copy kernels'
// and the checksum kernel's one access pattern, so a byte is summed exactly as it is copied.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "checksum_terms.h"

namespace kvtd::kernels {

__device__ __forceinline__ bool aligned_to(const void* p, std::uint64_t a) {
  return reinterpret_cast<std::uintptr_t>(p) % a == 0;
}

// One warp reads `bytes` from s with the widest access the addresses and size allow; kStore:
// stores them to d (a copy); kSum: returns this lane's share of their checksum (checksum.h),
// `at` being the offset of s[0] in its block (a multiple of 16), so a verified copy reads each
// byte once. Streaming loads and stores, so a swap does not evict the engine's working set.
template <bool kStore, bool kSum>
__device__ __forceinline__ unsigned long long warp_pass(unsigned char* __restrict__ d,
                                                        const unsigned char* __restrict__ s, std::uint64_t bytes,
                                                        unsigned lane, std::uint64_t at) {
  unsigned long long sum = 0;
  if (bytes % 16 == 0 && aligned_to(s, 16) && (!kStore || aligned_to(d, 16))) {
    const auto* sv = reinterpret_cast<const int4*>(s);
    auto* dv = reinterpret_cast<int4*>(d);
    const std::uint64_t n = bytes / 16;
    std::uint64_t i = lane;
    // Four loads in flight per lane before their stores: a load from host memory over PCIe takes
    // microseconds, and one outstanding load per lane leaves the link mostly idle.
    for (; i + 96 < n; i += 128) {
      const int4 a = __ldcs(sv + i), b = __ldcs(sv + i + 32), c = __ldcs(sv + i + 64), e = __ldcs(sv + i + 96);
      if constexpr (kStore) {
        __stcs(dv + i, a);
        __stcs(dv + i + 32, b);
        __stcs(dv + i + 64, c);
        __stcs(dv + i + 96, e);
      }
      if constexpr (kSum)
        sum += sum_terms(a, at + 16 * i) + sum_terms(b, at + 16 * (i + 32)) + sum_terms(c, at + 16 * (i + 64)) +
               sum_terms(e, at + 16 * (i + 96));
    }
    for (; i < n; i += 32) {
      const int4 a = __ldcs(sv + i);
      if constexpr (kStore) __stcs(dv + i, a);
      if constexpr (kSum) sum += sum_terms(a, at + 16 * i);
    }
  } else if (bytes % 8 == 0 && aligned_to(s, 8) && (!kStore || aligned_to(d, 8))) {
    const auto* sv = reinterpret_cast<const long long*>(s);
    auto* dv = reinterpret_cast<long long*>(d);
    for (std::uint64_t i = lane; i < bytes / 8; i += 32) {
      const long long v = __ldcs(sv + i);
      if constexpr (kStore) __stcs(dv + i, v);
      if constexpr (kSum) sum += sum_terms(v, at + 8 * i);
    }
  } else {
    for (std::uint64_t i = lane; i < bytes; i += 32) {
      const unsigned char v = __ldcs(s + i);
      if constexpr (kStore) __stcs(d + i, v);
      if constexpr (kSum) sum += sum_terms(v, at + i);
    }
  }
  return sum;
}

}  // namespace kvtd::kernels
