// CUDA device backend: opens the engine's tensors through CUDA IPC handles, keeps the host pool
// in pinned memory, and carries out copy plans on one stream per direction.
#include "kvtd/base/mutex.h"
#include "kvtd/daemon/device_backend.h"

#ifdef KVTD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include <sys/mman.h>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/kernels/cuda_copy.h"
#include "kvtd/proto/pci.h"
#endif

namespace kvtd::daemon {

#ifndef KVTD_HAVE_CUDA

bool cuda_compiled_in() { return false; }
bool cuda_stand_in() { return false; }

Result<std::unique_ptr<DeviceBackend>, DeviceErrc> make_cuda_backend(int, ScatterMode) {
  return make_error(DeviceErrc::kUnavailable, "this kvtd was built without the CUDA toolkit; use --device-backend host");
}

#else

bool cuda_compiled_in() { return true; }
#ifdef KVTD_CUDA_SIM
bool cuda_stand_in() { return true; }
#else
bool cuda_stand_in() { return false; }
#endif

namespace {

constexpr bool kHaveBatchCopy = CUDART_VERSION >= 13000;

std::string cuda_text(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

// Set once any call met a context-poisoning error: the CUDA context of this process is lost for
// good (every later call returns the same error), so the daemon must exit and be restarted.
std::atomic<bool> g_context_lost{false};

bool sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable: return true;
    default: return false;
  }
}

// What a failed call means for the backend: a sticky error marks the context lost.
DeviceErrc errc_of(cudaError_t e, DeviceErrc otherwise = DeviceErrc::kCopyFailed) {
  if (!sticky(e)) return otherwise;
  g_context_lost.store(true, std::memory_order_release);
  return DeviceErrc::kContextLost;
}

// One macro for every runtime call (NCCL's checks.h style): on failure it clears the runtime's
// last error (cudaGetLastError) so the error of this task is not reported again by the launch
// check of the next, healthy one, and returns it as a value. Callers that enqueued work first
// drain their stream before passing the error on (see Lane::drain).
#define KVTD_CUDA_TRY(call)                                                              \
  do {                                                                                   \
    if (const cudaError_t kvtd_e_ = (call); kvtd_e_ != cudaSuccess) {                    \
      (void)cudaGetLastError();                                                          \
      return make_error(errc_of(kvtd_e_), cuda_text(#call, kvtd_e_));                    \
    }                                                                                    \
  } while (0)

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

class CudaBackend final : public DeviceBackend {
  struct Lane;  // defined below; named early for the helpers' signatures

 public:
  CudaBackend(int device, ScatterMode mode) : device_(device), mode_(mode) {}

  ~CudaBackend() override {
    close_tensors();
    if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
    // Lanes release their mirrors, events and stream in their own destructors.
    for (void* p : host_) cudaFreeHost(p);
    for (auto [p, n] : registered_) {
      cudaHostUnregister(p);
      munmap(p, n);
    }
    for (void* p : device_allocs_) cudaFree(p);
    for (void* p : exported_) cudaFree(p);
  }

  Status<DeviceErrc> init() {
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
                        "device " + std::to_string(device_) +
                            " cannot use host pointers of registered memory in kernels "
                            "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0): use --scatter-mode batch or memcpy");
    host_pointers_ = host_pointers != 0;
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
    return {};
  }

  const char* name() const override { return "cuda"; }

  // Makes this backend's device current; every entry point calls it first.
  Status<DeviceErrc> use_device() {
    KVTD_CUDA_TRY(cudaSetDevice(device_));
    return {};
  }

  Result<std::byte*, DeviceErrc> open_tensor(const proto::TensorDesc& d) override {
    // The PCI address when the engine registered one: ordinals differ between processes under
    // CUDA_VISIBLE_DEVICES, so an equal ordinal can be another GPU and a different one the same.
    if (d.pci_bus_id != 0 && pci_bus_id_ != 0) {
      if (d.pci_bus_id != pci_bus_id_)
        return make_error(DeviceErrc::kOpenFailed, "tensor is on the GPU at PCI " + proto::pci_bus_id_string(d.pci_bus_id) +
                                                       " but this rank serves device " + std::to_string(device_) +
                                                       " at PCI " + proto::pci_bus_id_string(pci_bus_id_));
    } else if (d.device_id != device_) {
      return make_error(DeviceErrc::kOpenFailed, "tensor is on device " + std::to_string(d.device_id) +
                                                     " but this rank serves device " + std::to_string(device_) +
                                                     " (ordinals of the engine's process; register the PCI bus id "
                                                     "when CUDA_VISIBLE_DEVICES differs)");
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
      if (auto e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
        (void)cudaGetLastError();
        return make_error(DeviceErrc::kOpenFailed, cuda_text("cudaIpcOpenMemHandle", e));
      }
      it = opened_.emplace(key, p).first;
    }
    // Caching allocators hand out sub-allocations: the handle names the base, plus an offset.
    return static_cast<std::byte*>(it->second) + d.offset;
  }

  void close_tensors() override {
    if (opened_.empty()) return;
    if (!use_device().ok()) KVTD_WARN("cudaSetDevice failed while closing tensor handles");
    for (auto& [key, p] : opened_)  // each handle exactly once
      if (cudaIpcCloseMemHandle(p) != cudaSuccess) (void)cudaGetLastError();
    opened_.clear();
  }

  Result<std::byte*, DeviceErrc> alloc_host(std::size_t bytes) override {
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

  void free_host(std::byte* ptr) override {
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

  Status<DeviceErrc> pin_host(std::byte* addr, std::size_t bytes) override {
    KVTD_CUDA_TRY(cudaSetDevice(device_));
    if (auto e = cudaHostRegister(addr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped); e != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: a failed registration must not fail later healthy calls
      return make_error(DeviceErrc::kAllocFailed, cuda_text("cudaHostRegister", e));
    }
    return {};
  }

  void unpin_host(std::byte* addr) override {
    if (cudaSetDevice(device_) == cudaSuccess && cudaHostUnregister(addr) != cudaSuccess) (void)cudaGetLastError();
  }

  int numa_node() const override { return numa_node_; }
  bool broken() const override { return g_context_lost.load(std::memory_order_acquire); }

  Result<ExportedTensor, DeviceErrc> create_exported(std::size_t bytes, const std::string&) override {
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

  void free_exported() override {
    if (exported_.empty()) return;
    if (!use_device().ok()) KVTD_WARN("cudaSetDevice failed while freeing exported tensors");
    for (void* p : exported_)
      if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
    exported_.clear();
  }

  Result<std::byte*, DeviceErrc> alloc_device(std::size_t bytes) override {
    void* p = nullptr;
    if (auto st = use_device(); !st.ok()) return make_error(DeviceErrc::kAllocFailed, st.error().message);
    if (auto e = cudaMalloc(&p, bytes); e != cudaSuccess) {
      (void)cudaGetLastError();
      return make_error(DeviceErrc::kAllocFailed, cuda_text("cudaMalloc", e));
    }
    device_allocs_.push_back(p);
    return static_cast<std::byte*>(p);
  }

  // On a lane's own stream, not cudaMemcpy: the legacy default stream does not wait for the
  // lanes' non-blocking streams, so a plain cudaMemcpy could race a copy still in flight there.
  Status<DeviceErrc> write_device(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    return plain_copy(lane_of(Direction::kToDevice), dst, src, bytes);
  }

  Status<DeviceErrc> read_device(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    return plain_copy(lane_of(Direction::kToHost), dst, src, bytes);
  }

  Status<DeviceErrc> plain_copy(Lane& lane, std::byte* dst, const std::byte* src, std::size_t bytes) {
    MutexLock g(lane.mu);
    KVTD_CUDA_TRY(cudaSetDevice(device_));
    auto st = [&]() -> Status<DeviceErrc> {
      KVTD_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, lane.stream));
      KVTD_CUDA_TRY(cudaStreamSynchronize(lane.stream));
      return {};
    }();
    if (!st.ok()) lane.drain();
    return st;
  }

  Status<DeviceErrc> copy(Direction dir, const kernels::CopyPlan& plan,
                          std::span<const kernels::CopyTarget> targets) override {
    Lane& lane = lane_of(dir);
    MutexLock g(lane.mu);
    KVTD_CUDA_TRY(cudaSetDevice(device_));
    auto st = [&]() REQUIRES(lane.mu) -> Status<DeviceErrc> {
      if (auto s1 = stage_plan(lane, plan, targets); !s1.ok()) return s1;
      if (auto s2 = enqueue(lane, plan, targets, /*all_layers=*/true); !s2.ok()) return s2;
      KVTD_CUDA_TRY(cudaStreamSynchronize(lane.stream));
      return {};
    }();
    // On failure, copies enqueued before the failing call may still be running: wait for them,
    // because the runner releases this task's blocks (and the engine may reuse them) when we return.
    if (!st.ok()) lane.drain();
    return st;
  }

  Status<DeviceErrc> copy_layerwise(Direction dir, const kernels::CopyPlan& plan,
                                    std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                    const LayerCallback& on_layer_enqueued, const LayerCallback& on_layer_done) override {
    if (per_layer == 0) return {};
    Lane& lane = lane_of(dir);
    MutexLock g(lane.mu);
    KVTD_CUDA_TRY(cudaSetDevice(device_));
    auto st = copy_layerwise_locked(lane, plan, targets, per_layer, on_layer_enqueued, on_layer_done);
    if (!st.ok()) lane.drain();  // as in copy(): nothing may still write once we report failure
    return st;
  }

  Status<DeviceErrc> copy_layerwise_locked(Lane& lane, const kernels::CopyPlan& plan,
                                           std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                           const LayerCallback& on_layer_enqueued, const LayerCallback& on_layer_done) REQUIRES(lane.mu) {
    if (auto st = stage_plan(lane, plan, targets); !st.ok()) return st;
    const std::size_t layers = (targets.size() + per_layer - 1) / per_layer;
    if (auto st = ensure_events(lane, layers); !st.ok()) return st;
    // Enqueue every layer with an event after it, then report layers as their events fire, so
    // the copy of layer l+1 overlaps the engine's use of layer l.
    for (std::size_t l = 0; l < layers; ++l) {
      const std::size_t first = l * per_layer;
      const auto layer_targets = targets.subspan(first, std::min(per_layer, targets.size() - first));
      if (auto st = enqueue(lane, plan, layer_targets, /*all_layers=*/false, first); !st.ok()) return st;
      KVTD_CUDA_TRY(cudaEventRecord(lane.events[l], lane.stream));
      if (on_layer_enqueued) on_layer_enqueued(static_cast<std::uint32_t>(l));
    }
    for (std::size_t l = 0; l < layers; ++l) {
      KVTD_CUDA_TRY(cudaEventSynchronize(lane.events[l]));
      if (on_layer_done) on_layer_done(static_cast<std::uint32_t>(l));
    }
    return {};
  }

  Result<std::vector<std::array<std::uint8_t, proto::kHandleBytes>>, DeviceErrc> export_layer_events(
      std::uint32_t layers) override {
    Lane& lane = lane_of(Direction::kToDevice);
    MutexLock g(lane.mu);
    if (auto e = cudaSetDevice(device_); e != cudaSuccess) return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaSetDevice", e));
    if (auto st = ensure_events(lane, layers); !st.ok()) return st.error();
    std::vector<std::array<std::uint8_t, proto::kHandleBytes>> out(layers);
    for (std::uint32_t l = 0; l < layers; ++l) {
      cudaIpcEventHandle_t h{};
      static_assert(sizeof h == proto::kHandleBytes);
      if (auto e = cudaIpcGetEventHandle(&h, lane.events[l]); e != cudaSuccess)
        return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaIpcGetEventHandle", e));
      std::memcpy(out[l].data(), &h, sizeof h);
    }
    return out;
  }

  Status<DeviceErrc> gather_to_staging(std::span<const kernels::LayerTensor> tensors,
                                       std::span<const std::int32_t> ids, std::byte* staging) override {
    return transform(lane_of(Direction::kToHost), tensors, ids, staging, true);
  }

  Status<DeviceErrc> scatter_from_staging(std::span<const kernels::LayerTensor> tensors,
                                          std::span<const std::int32_t> ids, const std::byte* staging) override {
    return transform(lane_of(Direction::kToDevice), tensors, ids, const_cast<std::byte*>(staging), false);
  }

 private:
  // One direction's stream and staging. Owns its stream, events and mirrors (RAII).
  struct Lane {
    // One copy at a time per direction: the mirrors and the batch arrays are rewritten by each.
    Mutex mu;
    cudaStream_t stream = nullptr;  // set once when the backend is made
    Mirror ids GUARDED_BY(mu);      // [single_src..., single_dst...] (int32) or staging ids
    Mirror table GUARDED_BY(mu);    // CopyTarget or LayerTensor table for the one-launch kernels
    std::vector<std::byte> table_contents GUARDED_BY(mu);  // what table.dev holds (see upload_table)
    void* table_dev GUARDED_BY(mu) = nullptr;              // table.dev when table_contents was uploaded
    Mirror offsets GUARDED_BY(mu);  // staging offsets per tensor
    std::vector<cudaEvent_t> events GUARDED_BY(mu);
    std::vector<void*> batch_dst GUARDED_BY(mu);
    std::vector<void*> batch_src GUARDED_BY(mu);
    std::vector<std::size_t> batch_size GUARDED_BY(mu);

    Lane() = default;
    Lane(const Lane&) = delete;
    Lane& operator=(const Lane&) = delete;
    ~Lane() {
      drain();
      for (auto ev : events)
        if (cudaEventDestroy(ev) != cudaSuccess) (void)cudaGetLastError();
      if (stream && cudaStreamDestroy(stream) != cudaSuccess) (void)cudaGetLastError();
    }
    // Waits until nothing enqueued on the stream still runs; a failure (a broken context) is
    // cleared from the last-error slot: the task that met it already failed.
    void drain() {
      if (stream && cudaStreamSynchronize(stream) != cudaSuccess) (void)cudaGetLastError();
    }
  };

  Lane& lane_of(Direction d) { return lanes_[d == Direction::kToHost ? 0 : 1]; }

  // Per-layer events, interprocess so the engine can open them (which requires no timing).
  Status<DeviceErrc> ensure_events(Lane& lane, std::size_t layers) REQUIRES(lane.mu) {
    while (lane.events.size() < layers) {
      cudaEvent_t ev{};
      KVTD_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess));
      lane.events.push_back(ev);
    }
    return {};
  }

  // Uploads the scattered ids (and the target table for the all-layers kernel).
  Status<DeviceErrc> stage_plan(Lane& lane, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets) REQUIRES(lane.mu) {
    const std::size_t n = plan.single_src.size();
    if (n == 0 || mode_ == ScatterMode::kBatch || mode_ == ScatterMode::kMemcpy) return {};
    if (auto st = lane.ids.reserve(2 * n * sizeof(std::int32_t)); !st.ok()) return st;
    std::memcpy(lane.ids.host, plan.single_src.data(), n * sizeof(std::int32_t));
    std::memcpy(static_cast<std::int32_t*>(lane.ids.host) + n, plan.single_dst.data(), n * sizeof(std::int32_t));
    if (auto st = lane.ids.upload(2 * n * sizeof(std::int32_t), lane.stream); !st.ok()) return st;
    return upload_table(lane, targets.data(), targets.size_bytes());
  }

  // Uploads a target table unless the device copy holds these bytes already: the swap targets of
  // an attached cache never change, so steady-state tasks upload only their ids.
  Status<DeviceErrc> upload_table(Lane& lane, const void* table, std::size_t bytes) REQUIRES(lane.mu) {
    const auto* p = static_cast<const std::byte*>(table);
    if (lane.table.dev != nullptr && lane.table_dev == lane.table.dev && lane.table_contents.size() == bytes &&
        std::memcmp(lane.table_contents.data(), p, bytes) == 0)
      return {};
    lane.table_contents.clear();  // unknown until the upload below is enqueued
    if (auto st = lane.table.reserve(bytes); !st.ok()) return st;
    std::memcpy(lane.table.host, p, bytes);
    if (auto st = lane.table.upload(bytes, lane.stream); !st.ok()) return st;
    lane.table_contents.assign(p, p + bytes);
    lane.table_dev = lane.table.dev;
    return {};
  }

  // Enqueues runs and scattered blocks of `targets` (which start at index `first` of the staged
  // table). `all_layers` lets the all-layers kernel cover every target in one launch.
  Status<DeviceErrc> enqueue(Lane& lane, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
                             bool all_layers, std::size_t first = 0) REQUIRES(lane.mu) {
    // Batch mode: runs and scattered blocks of every target in one cudaMemcpyBatchAsync.
    if (mode_ == ScatterMode::kBatch) return enqueue_batch(lane, plan, targets);
    for (const auto& t : targets)
      for (const auto& r : plan.runs) {
        std::byte* d = t.dst + static_cast<std::uint64_t>(r.dst) * t.dst_stride;
        const std::byte* s = t.src + static_cast<std::uint64_t>(r.src) * t.src_stride;
        if (t.src_stride == t.block_bytes && t.dst_stride == t.block_bytes) {
          KVTD_CUDA_TRY(cudaMemcpyAsync(d, s, static_cast<std::uint64_t>(r.count) * t.block_bytes, cudaMemcpyDefault,
                                        lane.stream));
        } else {  // a page-first side: one 2-D copy, a row per block
          KVTD_CUDA_TRY(cudaMemcpy2DAsync(d, t.dst_stride, s, t.src_stride, t.block_bytes,
                                          static_cast<std::size_t>(r.count), cudaMemcpyDefault, lane.stream));
        }
      }
    const std::size_t n = plan.single_src.size();
    if (n == 0) return {};
    const auto* d_src = static_cast<const std::int32_t*>(lane.ids.dev);
    const auto* d_dst = d_src + n;
    switch (mode_) {
      case ScatterMode::kKernelAllLayers:
        if (all_layers || targets.size() > 1) {
          const auto* table = static_cast<const kernels::CopyTarget*>(lane.table.dev) + first;
          const int e = kernels::launch_scattered_copy_all(table, static_cast<std::uint32_t>(targets.size()), d_src,
                                                           d_dst, static_cast<std::int64_t>(n), lane.stream);
          if (e != 0) return make_error(errc_of(static_cast<cudaError_t>(e)), cuda_text("copy kernel", static_cast<cudaError_t>(e)));
          return {};
        }
        [[fallthrough]];
      case ScatterMode::kKernelPerLayer:
        for (const auto& t : targets) {
          const int e = kernels::launch_scattered_copy(t, d_src, d_dst, static_cast<std::int64_t>(n), lane.stream);
          if (e != 0) return make_error(errc_of(static_cast<cudaError_t>(e)), cuda_text("copy kernel", static_cast<cudaError_t>(e)));
        }
        return {};
      case ScatterMode::kMemcpy:
        for (const auto& t : targets)
          for (std::size_t i = 0; i < n; ++i)
            KVTD_CUDA_TRY(cudaMemcpyAsync(t.dst + static_cast<std::uint64_t>(plan.single_dst[i]) * t.dst_stride,
                                          t.src + static_cast<std::uint64_t>(plan.single_src[i]) * t.src_stride,
                                          t.block_bytes, cudaMemcpyDefault, lane.stream));
        return {};
      case ScatterMode::kBatch: return {};  // enqueued above
    }
    return {};
  }

  Status<DeviceErrc> enqueue_batch(Lane& lane, const kernels::CopyPlan& plan,
                                   std::span<const kernels::CopyTarget> targets) REQUIRES(lane.mu) {
#if CUDART_VERSION >= 13000
    const std::size_t n = plan.single_src.size();
    lane.batch_dst.clear();
    lane.batch_src.clear();
    lane.batch_size.clear();
    auto add = [&](std::byte* d, const std::byte* s, std::uint64_t bytes) REQUIRES(lane.mu) {
      lane.batch_dst.push_back(d);
      lane.batch_src.push_back(const_cast<std::byte*>(s));
      lane.batch_size.push_back(bytes);
    };
    for (const auto& t : targets) {
      for (const auto& r : plan.runs) {
        std::byte* d = t.dst + static_cast<std::uint64_t>(r.dst) * t.dst_stride;
        const std::byte* s = t.src + static_cast<std::uint64_t>(r.src) * t.src_stride;
        if (t.src_stride == t.block_bytes && t.dst_stride == t.block_bytes) {
          add(d, s, static_cast<std::uint64_t>(r.count) * t.block_bytes);  // a packed run: one copy
        } else {
          for (std::int64_t b = 0; b < r.count; ++b)
            add(d + static_cast<std::uint64_t>(b) * t.dst_stride, s + static_cast<std::uint64_t>(b) * t.src_stride,
                t.block_bytes);
        }
      }
      for (std::size_t i = 0; i < n; ++i)
        add(t.dst + static_cast<std::uint64_t>(plan.single_dst[i]) * t.dst_stride,
            t.src + static_cast<std::uint64_t>(plan.single_src[i]) * t.src_stride, t.block_bytes);
    }
    if (lane.batch_dst.empty()) return {};
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t attr_index = 0;
    KVTD_CUDA_TRY(cudaMemcpyBatchAsync(lane.batch_dst.data(), lane.batch_src.data(), lane.batch_size.data(),
                                       lane.batch_dst.size(), &attr, &attr_index, 1, lane.stream));
    return {};
#else
    (void)lane;
    (void)plan;
    (void)targets;
    return make_error(DeviceErrc::kCopyFailed, "cudaMemcpyBatchAsync needs CUDA 13");
#endif
  }

  Status<DeviceErrc> transform(Lane& lane, std::span<const kernels::LayerTensor> tensors,
                               std::span<const std::int32_t> ids, std::byte* staging, bool gather) {
    if (ids.empty() || tensors.empty()) return {};
    MutexLock g(lane.mu);
    KVTD_CUDA_TRY(cudaSetDevice(device_));
    auto st = transform_locked(lane, tensors, ids, staging, gather);
    if (!st.ok()) lane.drain();
    return st;
  }

  Status<DeviceErrc> transform_locked(Lane& lane, std::span<const kernels::LayerTensor> tensors,
                                      std::span<const std::int32_t> ids, std::byte* staging, bool gather) REQUIRES(lane.mu) {
    if (auto st = lane.ids.reserve(ids.size_bytes()); !st.ok()) return st;
    std::memcpy(lane.ids.host, ids.data(), ids.size_bytes());
    if (auto st = lane.ids.upload(ids.size_bytes(), lane.stream); !st.ok()) return st;
    if (auto st = upload_table(lane, tensors.data(), tensors.size_bytes()); !st.ok()) return st;
    if (auto st = lane.offsets.reserve(tensors.size() * sizeof(std::uint64_t)); !st.ok()) return st;
    auto* off = static_cast<std::uint64_t*>(lane.offsets.host);
    std::uint64_t object = 0;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      off[t] = object;
      object += tensors[t].block_bytes;
    }
    if (auto st = lane.offsets.upload(tensors.size() * sizeof(std::uint64_t), lane.stream); !st.ok()) return st;
    const auto* table = static_cast<const kernels::LayerTensor*>(lane.table.dev);
    const auto* offsets = static_cast<const std::uint64_t*>(lane.offsets.dev);
    const auto* d_ids = static_cast<const std::int32_t*>(lane.ids.dev);
    const auto count = static_cast<std::int64_t>(ids.size());
    const auto nt = static_cast<std::uint32_t>(tensors.size());
    if (!host_pointers_) {  // the kernel addresses the mapped staging by its device pointer
      void* mapped = nullptr;
      KVTD_CUDA_TRY(cudaHostGetDevicePointer(&mapped, staging, 0));
      staging = static_cast<std::byte*>(mapped);
    }
    const int e = gather ? kernels::launch_gather_to_staging(table, offsets, nt, d_ids, count, staging, object, lane.stream)
                         : kernels::launch_scatter_from_staging(table, offsets, nt, d_ids, count, staging, object, lane.stream);
    if (e != 0) return make_error(errc_of(static_cast<cudaError_t>(e)), cuda_text("layout kernel", static_cast<cudaError_t>(e)));
    KVTD_CUDA_TRY(cudaStreamSynchronize(lane.stream));
    return {};
  }

  int device_;
  ScatterMode mode_;
  std::array<Lane, 2> lanes_;
  std::map<std::array<std::uint8_t, proto::kHandleBytes>, void*> opened_;
  std::vector<void*> host_;
  std::vector<void*> device_allocs_;
  std::vector<void*> exported_;  // create_exported: FastDeploy's worker maps these
  std::vector<std::pair<void*, std::size_t>> registered_;  // NUMA-placed, cudaHostRegister'ed
  int numa_node_ = -1;
  bool host_pointers_ = true;  // cudaDevAttrCanUseHostPointerForRegisteredMem
  std::uint32_t pci_bus_id_ = 0;  // proto/pci.h packing; 0 unknown
};

}  // namespace

Result<std::unique_ptr<DeviceBackend>, DeviceErrc> make_cuda_backend(int device_id, ScatterMode mode) {
  if (mode == ScatterMode::kBatch && !kHaveBatchCopy)
    return make_error(DeviceErrc::kUnavailable, "--scatter-mode batch needs cudaMemcpyBatchAsync (CUDA 13 or newer)");
  int count = 0;
  if (auto e = cudaGetDeviceCount(&count); e != cudaSuccess)
    return make_error(DeviceErrc::kUnavailable, cuda_text("no usable CUDA driver or device (cudaGetDeviceCount)", e));
  if (device_id < 0 || device_id >= count)
    return make_error(DeviceErrc::kUnavailable, "--device-id " + std::to_string(device_id) + " but only " +
                                                    std::to_string(count) + " CUDA devices are visible");
  auto b = std::make_unique<CudaBackend>(device_id, mode);
  if (auto st = b->init(); !st.ok()) return st.error();
  return std::unique_ptr<DeviceBackend>(std::move(b));
}

#endif

}  // namespace kvtd::daemon
