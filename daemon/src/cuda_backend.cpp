// CUDA device backend: opens the engine's tensors through CUDA IPC handles, keeps the host pool
// in pinned memory, and carries out copy plans on one stream per direction.
#include "kvtd/daemon/device_backend.h"

#ifdef KVTD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "kvtd/kernels/cuda_copy.h"
#endif

namespace kvtd::daemon {

#ifndef KVTD_HAVE_CUDA

bool cuda_compiled_in() { return false; }

Result<std::unique_ptr<DeviceBackend>, DeviceErrc> make_cuda_backend(int) {
  return make_error(DeviceErrc::kUnavailable, "this kvtd was built without the CUDA toolkit; use --device-backend host");
}

#else

bool cuda_compiled_in() { return true; }

namespace {

std::string cuda_text(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

class CudaBackend final : public DeviceBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {}

  ~CudaBackend() override {
    close_tensors();
    cudaSetDevice(device_);
    for (auto& lane : lanes_) {
      if (lane.stream) cudaStreamDestroy(lane.stream);
      if (lane.d_ids) cudaFree(lane.d_ids);
      if (lane.h_ids) cudaFreeHost(lane.h_ids);
    }
    for (void* p : host_) cudaFreeHost(p);
  }

  Status<DeviceErrc> init() {
    if (auto e = cudaSetDevice(device_); e != cudaSuccess)
      return make_error(DeviceErrc::kUnavailable, cuda_text("cudaSetDevice", e));
    for (auto& lane : lanes_) {
      if (auto e = cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking); e != cudaSuccess)
        return make_error(DeviceErrc::kUnavailable, cuda_text("cudaStreamCreateWithFlags", e));
    }
    return {};
  }

  const char* name() const override { return "cuda"; }

  Result<std::byte*, DeviceErrc> open_tensor(const proto::TensorDesc& d) override {
    if (d.device_id != device_)
      return make_error(DeviceErrc::kOpenFailed, "tensor is on device " + std::to_string(d.device_id) +
                                                     " but this rank serves device " + std::to_string(device_));
    std::array<std::uint8_t, proto::kHandleBytes> key{};
    std::memcpy(key.data(), d.handle, key.size());
    auto it = opened_.find(key);
    if (it == opened_.end()) {
      cudaIpcMemHandle_t h{};
      static_assert(sizeof h == proto::kHandleBytes);
      std::memcpy(&h, d.handle, sizeof h);
      void* p = nullptr;
      cudaSetDevice(device_);
      if (auto e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess)
        return make_error(DeviceErrc::kOpenFailed, cuda_text("cudaIpcOpenMemHandle", e));
      it = opened_.emplace(key, p).first;
    }
    return static_cast<std::byte*>(it->second) + d.offset;
  }

  void close_tensors() override {
    if (opened_.empty()) return;
    cudaSetDevice(device_);
    for (auto& [key, p] : opened_) cudaIpcCloseMemHandle(p);  // each handle exactly once
    opened_.clear();
  }

  Result<std::byte*, DeviceErrc> alloc_host(std::size_t bytes) override {
    if (bytes == 0) return static_cast<std::byte*>(nullptr);
    void* p = nullptr;
    cudaSetDevice(device_);
    if (auto e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped); e != cudaSuccess)
      return make_error(DeviceErrc::kAllocFailed, cuda_text("cudaHostAlloc", e));
    std::memset(p, 0, bytes);
    host_.push_back(p);
    return static_cast<std::byte*>(p);
  }

  Status<DeviceErrc> copy(Direction dir, const kernels::CopyPlan& plan,
                          std::span<const kernels::CopyTarget> targets) override {
    Lane& lane = lanes_[dir == Direction::kToHost ? 0 : 1];
    std::lock_guard<std::mutex> g(lane.mu);
    if (auto e = cudaSetDevice(device_); e != cudaSuccess)
      return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaSetDevice", e));
    const std::size_t singles = plan.single_src.size();
    if (singles > 0) {
      if (auto st = stage_ids(lane, plan); !st.ok()) return st;
    }
    for (const auto& t : targets) {
      for (const auto& r : plan.runs) {
        const auto e = cudaMemcpyAsync(t.dst + static_cast<std::uint64_t>(r.dst) * t.block_bytes,
                                       t.src + static_cast<std::uint64_t>(r.src) * t.block_bytes,
                                       static_cast<std::uint64_t>(r.count) * t.block_bytes, cudaMemcpyDefault,
                                       lane.stream);
        if (e != cudaSuccess) return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaMemcpyAsync", e));
      }
      if (singles > 0) {
        const int e = kernels::launch_scattered_copy(t, lane.d_ids, lane.d_ids + singles,
                                                     static_cast<std::int64_t>(singles), lane.stream);
        if (e != 0)
          return make_error(DeviceErrc::kCopyFailed, std::string("scattered copy kernel: ") + kernels::cuda_error_text(e));
      }
    }
    if (auto e = cudaStreamSynchronize(lane.stream); e != cudaSuccess)
      return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaStreamSynchronize", e));
    return {};
  }

 private:
  struct Lane {
    std::mutex mu;
    cudaStream_t stream = nullptr;
    std::int32_t* d_ids = nullptr;  // device copy of [single_src..., single_dst...]
    std::int32_t* h_ids = nullptr;  // pinned staging for the upload
    std::size_t capacity = 0;       // ids each buffer holds
  };

  Status<DeviceErrc> stage_ids(Lane& lane, const kernels::CopyPlan& plan) {
    const std::size_t n = plan.single_src.size();
    if (2 * n > lane.capacity) {
      if (lane.d_ids) cudaFree(lane.d_ids);
      if (lane.h_ids) cudaFreeHost(lane.h_ids);
      lane.d_ids = nullptr;
      lane.h_ids = nullptr;
      lane.capacity = 0;
      const std::size_t cap = 2 * n < 8192 ? 8192 : 2 * n;
      if (auto e = cudaMalloc(reinterpret_cast<void**>(&lane.d_ids), cap * sizeof(std::int32_t)); e != cudaSuccess)
        return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaMalloc (block ids)", e));
      if (auto e = cudaHostAlloc(reinterpret_cast<void**>(&lane.h_ids), cap * sizeof(std::int32_t), cudaHostAllocDefault); e != cudaSuccess)
        return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaHostAlloc (block ids)", e));
      lane.capacity = cap;
    }
    // The previous task on this lane synchronised its stream, so the staging buffer is free.
    std::memcpy(lane.h_ids, plan.single_src.data(), n * sizeof(std::int32_t));
    std::memcpy(lane.h_ids + n, plan.single_dst.data(), n * sizeof(std::int32_t));
    if (auto e = cudaMemcpyAsync(lane.d_ids, lane.h_ids, 2 * n * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                 lane.stream);
        e != cudaSuccess)
      return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaMemcpyAsync (block ids)", e));
    return {};
  }

  int device_;
  std::array<Lane, 2> lanes_;
  std::map<std::array<std::uint8_t, proto::kHandleBytes>, void*> opened_;
  std::vector<void*> host_;
};

}  // namespace

Result<std::unique_ptr<DeviceBackend>, DeviceErrc> make_cuda_backend(int device_id) {
  int count = 0;
  if (auto e = cudaGetDeviceCount(&count); e != cudaSuccess)
    return make_error(DeviceErrc::kUnavailable, cuda_text("no usable CUDA driver or device (cudaGetDeviceCount)", e));
  if (device_id < 0 || device_id >= count)
    return make_error(DeviceErrc::kUnavailable, "--device-id " + std::to_string(device_id) + " but only " +
                                                    std::to_string(count) + " CUDA devices are visible");
  auto b = std::make_unique<CudaBackend>(device_id);
  if (auto st = b->init(); !st.ok()) return st.error();
  return std::unique_ptr<DeviceBackend>(std::move(b));
}

#endif

}  // namespace kvtd::daemon
