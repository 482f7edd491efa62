// cudasim_copy16.h (tests) - the smallest kernel written as kvtd's are, for the stand-in's tests
// of what device code may touch: one 16-byte streaming load and store.
#pragma once

#include "cuda_runtime.h"  // the stand-in's: kernels, launches, __ldcs/__stcs
#include "cuda_runtime_api.h"

namespace cudasim_test {

__global__ inline void copy16(const int4* src, int4* dst) { __stcs(dst, __ldcs(src)); }

// Runs copy16 once on a new stream and returns what the stream's synchronisation says.
inline cudaError_t run_copy16(const void* src, void* dst) {
  cudaStream_t s{};
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return cudaErrorUnknown;
  if (const cudaError_t e = cudasim::launch(copy16, dim3(1), dim3(1), 0, s, static_cast<const int4*>(src),
                                            static_cast<int4*>(dst));
      e != cudaSuccess)
    return e;
  return cudaStreamSynchronize(s);
}

}  // namespace cudasim_test
