// The CUDA backend's device memory and tensors: init, IPC handles opened as tensors, pinned and
// NUMA-placed host memory, exported allocations; and the factory.
#include "cuda/cuda_backend.h"

#include <cstdlib>
#include <cstring>
#include <fmt/format.h>

#include "cuda/footprint.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/proto/pci.h"

namespace kvtd::daemon::cuda {

Status<DeviceErrc> CudaBackend::init() {
  if (auto e = cudaSetDevice(device_); e != cudaSuccess)
    return make_error(DeviceErrc::kUnavailable, cuda_text("cudaSetDevice", e));
  // Threads waiting for a copy sleep in the driver instead of spinning a core each beside the
  // engine (the default spins while it has spare cores).
  if (auto e = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync); e != cudaSuccess) {
    (void)cudaGetLastError();
    KVTD_WARN("cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync): {}; waits may spin", cuda_text("", e));
  }
  // The kernels dereference host-pool pointers directly: only valid where registered host
  // memory is addressable by its host pointer. Elsewhere the copy engines must do it.
  int host_pointers = 0;
  if (cudaDeviceGetAttribute(&host_pointers, cudaDevAttrCanUseHostPointerForRegisteredMem, device_) != cudaSuccess) {
    (void)cudaGetLastError();
    host_pointers = 0;
  }
  if (!host_pointers && (mode_ == ScatterMode::kKernelAllLayers || mode_ == ScatterMode::kKernelPerLayer))
    return make_error(DeviceErrc::kUnavailable,
                      fmt::format("device {} cannot use host pointers of registered memory in kernels "
                                  "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0): use --scatter-mode batch or "
                                  "memcpy",
                                  device_));
  host_pointers_ = host_pointers != 0;
  if (int sms = 0; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_) == cudaSuccess && sms > 0)
    fill_warps_ = static_cast<std::uint64_t>(sms) * kFillWarpsPerSm;
  else
    (void)cudaGetLastError();  // keep the default (108 SMs, an A100's)
  report_device_sharing();
  for (auto& lane : lanes_) {
    if (auto e = cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking); e != cudaSuccess)
      return make_error(DeviceErrc::kUnavailable, cuda_text("cudaStreamCreateWithFlags", e));
  }
  char bus_id[32] = {0};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, device_) != cudaSuccess) bus_id[0] = '\0';
  (void)cudaGetLastError();  // a failed query must not fail the first task
  pci_bus_id_ = proto::parse_pci_bus_id(bus_id).value_or(0);
  std::string how;
  numa_node_ = numa_node_of_gpu(bus_id, device_, "/sys", &how);
  KVTD_INFO("cuda device {} (PCI {}) is on NUMA node {} ({})", device_, bus_id, numa_node_,
            numa_node_ >= 0 ? how : std::string("sysfs does not say"));
  KVTD_INFO("cuda device {}: this daemon holds {} of its memory", device_, device_footprint());
  return {};
}

std::string CudaBackend::device_footprint() {
  // What the engine loses to the daemon: mostly the context (hundreds of MiB), then the lanes'
  // streams and id/table mirrors. Only the driver knows the context's share.
  const auto bytes = pci_bus_id_ != 0 ? process_device_bytes(proto::pci_bus_id_string(pci_bus_id_)) : std::nullopt;
  if (!bytes) return "an unknown amount (NVML is not loadable here or does not list this process)";
  char text[96];
  std::snprintf(text, sizeof text, "%.0f MiB (NVML: context, streams and allocations)",
                static_cast<double>(*bytes) / (1 << 20));
  return text;
}

void CudaBackend::report_device_sharing() {
  // The engine and kvtd are two processes on one GPU: EXCLUSIVE_PROCESS admits one context (or
  // the MPS server's clients only), so whichever starts second fails to create its context.
  int mode = cudaComputeModeDefault;
  if (cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, device_) != cudaSuccess) (void)cudaGetLastError();
  if (mode == cudaComputeModeExclusiveProcess)
    KVTD_WARN("cuda device {} is in EXCLUSIVE_PROCESS compute mode: the engine and kvtd can share it only through "
              "MPS (start nvidia-cuda-mps-control and give both the same CUDA_MPS_PIPE_DIRECTORY), else set "
              "nvidia-smi -c DEFAULT",
              device_);
  else if (mode == cudaComputeModeProhibited)
    KVTD_WARN("cuda device {} is in PROHIBITED compute mode: no process may use it", device_);
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  // The daemon's own footprint is its context plus the lanes' small mirrors (ids, tables):
  // what the engine loses to it is visible as the drop in free memory when the daemon starts.
  KVTD_INFO("cuda device {}: {:.0f} MiB free of {:.0f} MiB with this daemon's context (compute mode {})", device_,
            static_cast<double>(free_bytes) / (1 << 20), static_cast<double>(total_bytes) / (1 << 20),
            mode == cudaComputeModeDefault ? "default" : mode == cudaComputeModeExclusiveProcess ? "exclusive-process" : "other");
}

Status<DeviceErrc> CudaBackend::use_device() {
  KVTD_CUDA_TRY(cudaSetDevice(device_));
  return {};
}

Result<std::byte*, DeviceErrc> CudaBackend::open_tensor(const proto::TensorDesc& d) {
  // The PCI address when the engine registered one: ordinals differ between processes under
  // CUDA_VISIBLE_DEVICES, so an equal ordinal can be another GPU and a different one the same.
  if (d.pci_bus_id != 0 && pci_bus_id_ != 0) {
    if (d.pci_bus_id != pci_bus_id_)
      return make_error(DeviceErrc::kOpenFailed,
                        fmt::format("tensor is on the GPU at PCI {} but this rank serves device {} at PCI {}",
                                    proto::pci_bus_id_string(d.pci_bus_id), device_,
                                    proto::pci_bus_id_string(pci_bus_id_)));
  } else if (d.device_id != device_) {
    return make_error(DeviceErrc::kOpenFailed, fmt::format("tensor is on device {} but this rank serves device {} "
                                                           "(ordinals of the engine's process; register the PCI bus id "
                                                           "when CUDA_VISIBLE_DEVICES differs)",
                                                           d.device_id, device_));
  }
  std::array<std::uint8_t, proto::kHandleBytes> key{};
  std::memcpy(key.data(), d.handle, key.size());
  auto it = opened_.find(key);
  if (it == opened_.end()) {
    cudaIpcMemHandle_t h{};
    static_assert(sizeof h == proto::kHandleBytes);
    std::memcpy(&h, d.handle, sizeof h);
    void* p = nullptr;
    if (auto st = use_device(); !st.ok()) return make_error(DeviceErrc::kOpenFailed, st.error().message);
    if (auto e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess)
      return make_error(errc_of(e, DeviceErrc::kOpenFailed), cuda_text("cudaIpcOpenMemHandle", e));
    it = opened_.emplace(key, Opened{p, allocation_bytes(p)}).first;
  }
  // Caching allocators hand out sub-allocations: the handle names the base, plus an offset. A
  // wrong offset or size would make every DMA of this tensor write the engine's neighbouring
  // tensors (or fault), so the range must lie inside the allocation the handle opened.
  const std::uint64_t size = it->second.bytes;
  if (size != 0 && (d.offset > size || d.bytes > size - d.offset))
    return make_error(DeviceErrc::kOpenFailed,
                      fmt::format("tensor (rank {}, layer {}, {}) is registered at offset {} with {} bytes, past the "
                                  "end of the allocation its IPC handle names ({} bytes): the engine registered the "
                                  "wrong handle, offset or size",
                                  d.rank, d.layer, proto::tensor_kind_name(static_cast<proto::TensorKind>(d.kind)),
                                  d.offset, d.bytes, size));
  return static_cast<std::byte*>(it->second.base) + d.offset;
}

std::uint64_t CudaBackend::allocation_bytes(void* base) {
  // The driver API's cuMemGetAddressRange through the runtime's entry point: linking libcuda
  // directly would make the daemon unloadable on machines without a driver (the host backend).
  using AddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static AddressRange fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<AddressRange>(f);
  }();
  CUdeviceptr b = 0;
  size_t size = 0;
  if (fn == nullptr || fn(&b, &size, reinterpret_cast<CUdeviceptr>(base)) != CUDA_SUCCESS) {
    KVTD_WARN("the size of an opened IPC allocation is unknown (cuMemGetAddressRange {}): tensor bounds unchecked",
              fn == nullptr ? "not found" : "failed");
    return 0;
  }
  return size - (reinterpret_cast<CUdeviceptr>(base) - b);
}

void CudaBackend::close_tensors() {
  // Both lanes held while their streams drain and the handles close: no copy is mid-enqueue and
  // none still runs when a mapping goes.
  Lane& host_lane = lane_of(Direction::kToHost);
  Lane& device_lane = lane_of(Direction::kToDevice);  // named apart: the analysis sees two mutexes
  MutexLock to_host(host_lane.mu);
  MutexLock to_device(device_lane.mu);
  if (!use_device().ok()) KVTD_WARN("cudaSetDevice failed while closing tensor handles");
  for (auto& lane : lanes_) lane.drain();
  destroy_engine_events();  // the engine's session is over: its events go with its tensors
  if (opened_.empty()) return;
  for (auto& [key, o] : opened_)  // each handle exactly once
    if (cudaIpcCloseMemHandle(o.base) != cudaSuccess) (void)cudaGetLastError();
  opened_.clear();
}

Result<std::byte*, DeviceErrc> CudaBackend::alloc_host(std::size_t bytes) {
  if (bytes == 0) return static_cast<std::byte*>(nullptr);
  void* p = nullptr;
  if (auto st = use_device(); !st.ok()) return make_error(DeviceErrc::kAllocFailed, st.error().message);
  if (numa_node_ >= 0) {
    // Placed memory: map, bind to the GPU's node, fault it in there, then pin it for DMA.
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    std::string why;
    if (p != MAP_FAILED && bind_to_numa_node(p, bytes, numa_node_, &why)) {
      std::memset(p, 0, bytes);
      if (auto e = cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped); e == cudaSuccess) {
        registered_.emplace_back(p, bytes);
        return static_cast<std::byte*>(p);
      } else {
        // Cleared here: a stale error would fail the next kernel launch's check (a healthy task).
        (void)cudaGetLastError();
        why = cuda_text("cudaHostRegister", e);
      }
    }
    if (p != MAP_FAILED) munmap(p, bytes);
    KVTD_WARN("host memory not placed on NUMA node {} ({}); using cudaHostAlloc", numa_node_, why);
    p = nullptr;
  }
  if (auto e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped); e != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error(DeviceErrc::kAllocFailed, cuda_text("cudaHostAlloc", e));
  }
  std::memset(p, 0, bytes);
  host_.push_back(p);
  return static_cast<std::byte*>(p);
}

void CudaBackend::free_host(std::byte* ptr) {
  if (ptr == nullptr) return;
  if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  for (auto it = registered_.begin(); it != registered_.end(); ++it)
    if (it->first == ptr) {
      if (cudaHostUnregister(it->first) != cudaSuccess) (void)cudaGetLastError();
      munmap(it->first, it->second);
      registered_.erase(it);
      return;
    }
  for (auto it = host_.begin(); it != host_.end(); ++it)
    if (*it == ptr) {
      if (cudaFreeHost(*it) != cudaSuccess) (void)cudaGetLastError();
      host_.erase(it);
      return;
    }
}

Status<DeviceErrc> CudaBackend::pin_host(std::byte* addr, std::size_t bytes) {
  KVTD_CUDA_TRY(cudaSetDevice(device_));
  if (auto e = cudaHostRegister(addr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped); e != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: a failed registration must not fail later healthy calls
    return make_error(DeviceErrc::kAllocFailed, cuda_text("cudaHostRegister", e));
  }
  return {};
}

void CudaBackend::unpin_host(std::byte* addr) {
  if (cudaSetDevice(device_) == cudaSuccess && cudaHostUnregister(addr) != cudaSuccess) (void)cudaGetLastError();
}

Result<DeviceBackend::ExportedTensor, DeviceErrc> CudaBackend::create_exported(std::size_t bytes, const std::string&) {
  ExportedTensor t;
  void* p = nullptr;
  if (auto st = use_device(); !st.ok()) return make_error(DeviceErrc::kAllocFailed, st.error().message);
  if (auto e = cudaMalloc(&p, bytes); e != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error(DeviceErrc::kAllocFailed, cuda_text("cudaMalloc", e));
  }
  exported_.push_back(p);
  // Zero-filled like FastDeploy's paddle.full(0). cudaMemset runs on the legacy stream, which
  // the lanes' non-blocking streams do not wait for: synchronise before any lane touches it.
  cudaIpcMemHandle_t h{};
  static_assert(sizeof h == proto::kHandleBytes);
  cudaError_t e = cudaMemset(p, 0, bytes);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaIpcGetMemHandle(&h, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error(DeviceErrc::kAllocFailed, cuda_text("exporting a cache tensor", e));
  }
  t.ptr = static_cast<std::byte*>(p);
  std::memcpy(t.handle.data(), &h, sizeof h);
  return t;
}

void CudaBackend::free_exported() {
  if (exported_.empty()) return;
  if (!use_device().ok()) KVTD_WARN("cudaSetDevice failed while freeing exported tensors");
  for (void* p : exported_)
    if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
  exported_.clear();
}

Result<std::byte*, DeviceErrc> CudaBackend::alloc_device(std::size_t bytes) {
  void* p = nullptr;
  if (auto st = use_device(); !st.ok()) return make_error(DeviceErrc::kAllocFailed, st.error().message);
  if (auto e = cudaMalloc(&p, bytes); e != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error(DeviceErrc::kAllocFailed, cuda_text("cudaMalloc", e));
  }
  device_allocs_.push_back(p);
  return static_cast<std::byte*>(p);
}

}  // namespace kvtd::daemon::cuda

namespace kvtd::daemon {

namespace cuda {

// KVTD_KERNEL_PIECE_KIB (a benchmark's sweep: docs/gpu.md) fixes the part; unset, parts follow
// each launch's size.
std::optional<std::uint64_t> kernel_piece_bytes() {
  if (const char* v = std::getenv("KVTD_KERNEL_PIECE_KIB"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const unsigned long long kib = std::strtoull(v, &end, 10);
    if (end != v && *end == '\0' && kib <= 1024) return kib << 10;
    KVTD_WARN("KVTD_KERNEL_PIECE_KIB='{}' is not a number of KiB in [0, 1024] (0: whole blocks); parts follow each "
              "launch's size", v);
  }
  return std::nullopt;
}

}  // namespace cuda

bool cuda_compiled_in() { return true; }
#ifdef KVTD_CUDA_SIM
bool cuda_stand_in() { return true; }
#else
bool cuda_stand_in() { return false; }
#endif

Result<std::unique_ptr<DeviceBackend>, DeviceErrc> make_cuda_backend(int device_id, ScatterMode mode,
                                                                     std::size_t copy_batch_max,
                                                                     std::uint32_t copy_wait_spin_us) {
  if (mode == ScatterMode::kBatch && !cuda::kHaveBatchCopy)
    return make_error(DeviceErrc::kUnavailable, "--scatter-mode batch needs cudaMemcpyBatchAsync (CUDA 13 or newer)");
  int count = 0;
  if (auto e = cudaGetDeviceCount(&count); e != cudaSuccess)
    return make_error(DeviceErrc::kUnavailable, cuda::cuda_text("no usable CUDA driver or device (cudaGetDeviceCount)", e));
  if (device_id < 0 || device_id >= count)
    return make_error(DeviceErrc::kUnavailable,
                      fmt::format("--device-id {} but only {} CUDA devices are visible", device_id, count));
  auto b = std::make_unique<cuda::CudaBackend>(device_id, mode, std::max<std::size_t>(copy_batch_max, 1),
                                               cuda::kernel_piece_bytes(), copy_wait_spin_us);
  KVTD_TRY(b->init());
  return std::unique_ptr<DeviceBackend>(std::move(b));
}

}  // namespace kvtd::daemon
