// cuda_runtime.h of the CUDA stand-in build (-DKVTD_CUDA_SIM=ON): lets kvtd's own .cu sources
// compile with the host compiler. The runtime API and its types come from the toolkit's
// cuda_runtime_api.h (the real declarations, implemented by libkvtd_cudasim); this header adds
// what device code uses: __global__/__device__, the built-in index variables, __ldcs/__stcs and
// a launch that runs the grid on the stream's worker thread, block after block and thread after
// thread (the kernels' warp-per-block code as written; no shared memory or __syncthreads).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

// The toolkit's host_defines.h gives these compiler-specific meanings; here they mean nothing.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

namespace cudasim {

extern thread_local uint3 tl_thread_idx;
extern thread_local uint3 tl_block_idx;
extern thread_local dim3 tl_block_dim;
extern thread_local dim3 tl_grid_dim;

// Checks the launch configuration (and injected faults of "cudaLaunchKernel"), then enqueues
// `body` for every (block, thread) of the grid on `stream`. The error is also the thread's last
// error, as for a real launch.
cudaError_t enqueue_launch(cudaStream_t stream, dim3 grid, dim3 block, std::function<void()> body);

// kernel<<<grid, block, shared, stream>>>(args...): the arguments are copied at launch.
template <typename... P, typename... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                   A&&... args) {
  (void)shared_bytes;
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  return enqueue_launch(stream, grid, block, [kernel, params] { std::apply(kernel, params); });
}

}  // namespace cudasim

#define threadIdx (::cudasim::tl_thread_idx)
#define blockIdx (::cudasim::tl_block_idx)
#define blockDim (::cudasim::tl_block_dim)
#define gridDim (::cudasim::tl_grid_dim)

// Streaming loads and stores: plain accesses on the CPU.
template <typename T>
inline T __ldcs(const T* p) {
  return *p;
}
template <typename T>
inline void __stcs(T* p, T v) {
  *p = v;
}
