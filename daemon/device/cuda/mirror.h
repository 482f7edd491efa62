// mirror.h (daemon-internal, CUDA builds only) - pinned host staging and its device copy, for
// the ids and target tables a copy uploads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/cuda_check.h"

namespace kvtd::daemon::cuda {

// A growable pair of buffers: pinned host staging and its device copy. Owns both (RAII).
struct Mirror {
  void* host = nullptr;
  void* dev = nullptr;
  std::size_t bytes = 0;

  Mirror() = default;
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  ~Mirror() { release(); }

  Status<DeviceErrc> reserve(std::size_t want) {
    if (want <= bytes) return {};
    release();
    const std::size_t cap = want < 65536 ? 65536 : want;
    KVTD_CUDA_TRY(cudaHostAlloc(&host, cap, cudaHostAllocDefault));
    KVTD_CUDA_TRY(cudaMalloc(&dev, cap));
    bytes = cap;
    return {};
  }
  void release() {
    if (host && cudaFreeHost(host) != cudaSuccess) (void)cudaGetLastError();
    if (dev && cudaFree(dev) != cudaSuccess) (void)cudaGetLastError();
    host = dev = nullptr;
    bytes = 0;
  }
  // Uploads the first `n` bytes of `host` on `stream`. Every user of a lane leaves its stream
  // idle when it returns (synchronised on success, drained on error), so the pinned staging is
  // free to overwrite when the next task stages its plan.
  Status<DeviceErrc> upload(std::size_t n, cudaStream_t stream) {
    KVTD_CUDA_TRY(cudaMemcpyAsync(dev, host, n, cudaMemcpyHostToDevice, stream));
    return {};
  }
};

}  // namespace kvtd::daemon::cuda
