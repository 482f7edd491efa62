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
#include <vector>

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
// error, as for a real launch. `pointer_args`: the kernel's pointer arguments, the device memory
// it may index directly (device memory is sealed from the CPU outside device work).
cudaError_t enqueue_launch(cudaStream_t stream, dim3 grid, dim3 block, std::vector<const void*> pointer_args,
                           std::function<void()> body);

// What the GPU checks on a device-code access of `bytes` at `p`: natural alignment (a 16-byte
// vector access at an address not a multiple of 16 is cudaErrorMisalignedAddress) and that the
// address is device memory, or pinned host memory by its device address (the host address
// itself unless CanUseHostPointerForRegisteredMem is 0; anything else is
// cudaErrorIllegalAddress). A failing access throws; the launch catches it, stops the kernel and
// breaks the context, as the hardware does. Returns where the access lands on the CPU.
void* device_access(const void* p, std::size_t bytes);

template <typename T>
void add_pointer_arg(std::vector<const void*>& out, const T& arg) {
  if constexpr (std::is_pointer_v<T>) out.push_back(static_cast<const void*>(arg));
}

// kernel<<<grid, block, shared, stream>>>(args...): the arguments are copied at launch.
template <typename... P, typename... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                   A&&... args) {
  (void)shared_bytes;
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  std::vector<const void*> pointers;
  std::apply([&pointers](const auto&... p) { (add_pointer_arg(pointers, p), ...); }, params);
  return enqueue_launch(stream, grid, block, std::move(pointers), [kernel, params] { std::apply(kernel, params); });
}

}  // namespace cudasim

#define threadIdx (::cudasim::tl_thread_idx)
#define blockIdx (::cudasim::tl_block_idx)
#define blockDim (::cudasim::tl_block_dim)
#define gridDim (::cudasim::tl_grid_dim)

// Streaming loads and stores: plain accesses on the CPU, checked as the GPU checks them.
template <typename T>
inline T __ldcs(const T* p) {
  return *static_cast<const T*>(::cudasim::device_access(p, sizeof(T)));
}
template <typename T>
inline void __stcs(T* p, T v) {
  *static_cast<T*>(::cudasim::device_access(p, sizeof(T))) = v;
}
// Atomic add (kernels of different streams may run at once on their workers).
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(static_cast<unsigned long long*>(::cudasim::device_access(p, sizeof *p)), v,
                            __ATOMIC_RELAXED);
}
