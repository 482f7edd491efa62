// launch.h (kernels-internal) - KVTD_LAUNCH(kernel, grid, block, stream, args...): the kernel
// launch of every .cu file here. nvcc: kernel<<<grid, block, 0, stream>>>(args); the stand-in
// build (KVTD_CUDA_SIM) compiles the .cu files as C++ and runs the grid on the stream's worker
// thread instead (cudasim::launch).
#pragma once

#include <cuda_runtime.h>

#ifdef KVTD_CUDA_SIM
#define KVTD_LAUNCH(kernel, grid, block, stream, ...) \
  (void)::cudasim::launch(kernel, dim3(grid), dim3(block), 0, stream, __VA_ARGS__)
#else
#define KVTD_LAUNCH(kernel, grid, block, stream, ...) kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#endif
