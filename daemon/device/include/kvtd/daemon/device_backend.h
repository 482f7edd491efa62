// kvtd/daemon/device_backend.h - where the "device" tensors live and how plans are carried out.
//
// Two implementations: the host backend (device tensors are shared-memory objects made by the
// engine side; plans run with memcpy) and the CUDA backend (cudaIpcOpenMemHandle, pinned host
// memory, cudaMemcpyAsync for runs and a copy kernel for scattered blocks). Everything above
// this interface is the same code, which is how the daemon is tested without a GPU.
//
// Ownership: a backend owns every tensor mapping it opened and every host buffer it allocated;
// close_tensors() releases the mappings exactly once (also done by the destructor).
// Thread-safety: copies may run concurrently for the two directions (each has its own stream);
// open/close/alloc are called from one thread while no copy runs.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvtd/device_modes.h"
#include "kvtd/kernels/copy_plan.h"
#include "kvtd/kernels/host_copy.h"
#include "kvtd/kernels/layout.h"
#include "kvtd/proto/expected.h"
#include "kvtd/proto/session.h"

namespace kvtd::daemon {

enum class DeviceErrc {
  kUnavailable,  // backend cannot run here (no driver, no device, not compiled in)
  kOpenFailed,   // a tensor handle could not be opened or is too small
  kAllocFailed,  // pinned host memory could not be allocated
  kCopyFailed,   // a copy failed (message carries the driver's error string)
  kContextLost,  // a sticky device error (illegal address, launch failure, ...): every later call
                 // fails; the process must exit so the device context is rebuilt
  kEventNotFired,  // the engine's event did not complete within the caller's bound; nothing copied
};

enum class Direction { kToHost, kToDevice };

// A backend is four narrow interfaces; each consumer takes only the one it uses (the task
// runner a CopyEngine, the host pool HostMemory, the cache mapping a TensorMapper, the storage
// executor a CopyEngine and HostMemory); the self-test alone reaches SelfTestDevice.

// The engine's tensors: opened from their registered handles, or made here for another process.
class TensorMapper {
 public:
  virtual ~TensorMapper() = default;
  // Maps one registered tensor and returns the address of its first byte (handle base plus the
  // recorded offset). Opening the same handle twice maps it once.
  virtual Result<std::byte*, DeviceErrc> open_tensor(const proto::TensorDesc& desc) = 0;
  // Releases every mapping opened since the last call (engine events included).
  virtual void close_tensors() = 0;

  // Device memory this process allocates for another process to map (FastDeploy's
  // --create_cache_tensor: the transfer manager makes the KV cache and FastDeploy's worker maps
  // it by name). Zero-filled. `handle` is what the other process opens: a cudaIpcMemHandle_t, or
  // on the host backend the name of the shared-memory object made for it (`object_name`, ignored
  // by CUDA). This process uses `ptr` itself (CUDA cannot open its own handles). Freed by
  // free_exported(), every one at once, and by the destructor.
  struct ExportedTensor {
    std::byte* ptr = nullptr;
    std::array<std::uint8_t, proto::kHandleBytes> handle{};
  };
  virtual Result<ExportedTensor, DeviceErrc> create_exported(std::size_t bytes, const std::string& object_name) = 0;
  virtual void free_exported() = 0;
};

// Host memory for the device: staging (taken as a HostBuffer, below, which gives it back) and
// the host pool's pages, pinned.
class HostMemory {
 public:
  virtual ~HostMemory() = default;
  // Host memory (pinned for DMA on CUDA), zero-filled, until free_host(ptr) or the backend's end.
  // Callers hold it as a HostBuffer (HostBuffer::allocate), which returns it.
  virtual Result<std::byte*, DeviceErrc> alloc_host(std::size_t bytes) = 0;
  // Returns memory from alloc_host; null or unknown pointers are ignored.
  virtual void free_host(std::byte* ptr) = 0;
  // Pins memory the caller mapped (cudaHostRegister on CUDA; nothing on the host backend) until
  // unpin_host(addr). The caller keeps it mapped until then.
  virtual Status<DeviceErrc> pin_host(std::byte* addr, std::size_t bytes) = 0;
  virtual void unpin_host(std::byte* addr) = 0;
  // Whether pin_host does anything (false on the host backend: CPU copies need no pinning).
  virtual bool pins_memory() const { return true; }
  // NUMA node of the device (host memory for it belongs there), or -1 when unknown.
  virtual int numa_node() const { return -1; }
};

// Copies between the mapped tensors and host memory, per direction.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  // Carries out `plan` for every target, in the direction's stream, and returns when done.
  virtual Status<DeviceErrc> copy(Direction dir, const kernels::CopyPlan& plan,
                                  std::span<const kernels::CopyTarget> targets) = 0;

  // Layer by layer: `targets_per_layer` consecutive targets form a layer. on_layer_enqueued(l)
  // is called once layer l's copies are queued and its event recorded, on_layer_done(l) once
  // they completed (on CUDA: the event fired); both in layer order. Either may be empty.
  using LayerCallback = std::function<void(std::uint32_t layer)>;
  virtual Status<DeviceErrc> copy_layerwise(Direction dir, const kernels::CopyPlan& plan,
                                            std::span<const kernels::CopyTarget> targets,
                                            std::size_t targets_per_layer, const LayerCallback& on_layer_enqueued,
                                            const LayerCallback& on_layer_done) = 0;

  // Returns once the engine's interprocess event `handle` completed (its GPU work on the blocks
  // is done), polling it from this host thread; asks `give_up` between polls and, when it names a
  // reason, fails with kEventNotFired and that reason (the engine died, a deadline passed). Never
  // makes a stream wait on the device: a stream waiting on an event whose exporting process died
  // with its record queued never runs again (H100, driver 580: still stuck after 120 s), and the
  // lane behind it would be wedged for good. Each handle is opened once and kept until
  // close_tensors(). The host backend has no streams (the engine's writes to its tensors are done
  // when it submits): ok at once. Thread-safe.
  using GiveUp = std::function<std::optional<std::string>()>;
  virtual Status<DeviceErrc> await_engine_event(const std::array<std::uint8_t, proto::kEngineEventBytes>& handle,
                                                const GiveUp& give_up) {
    (void)handle;
    (void)give_up;
    return {};
  }

  // --verify-swaps: the checksums (kvtd/kernels/checksum.h) of blocks `ids` on the device side of
  // every target (the source of kToHost targets, the destination of kToDevice ones):
  // out[t * ids.size() + i]. Computed where the blocks are (on CUDA by a kernel on the
  // direction's stream, after what it ran before); returns when done. The default reads them
  // with the CPU (the host backend's tensors are host memory). Thread-safe.
  virtual Result<std::vector<std::uint64_t>, DeviceErrc> device_checksums(
      Direction dir, std::span<const kernels::CopyTarget> targets, std::span<const std::int32_t> ids);
  // copy(), then device_checksums() of `ids` (none: an empty result) once the copy is done. On
  // CUDA the checksum kernel runs on the copy's stream right behind it and the task waits once;
  // the default makes the two calls. Thread-safe.
  virtual Result<std::vector<std::uint64_t>, DeviceErrc> copy_with_checksums(
      Direction dir, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
      std::span<const std::int32_t> ids);

  // copy_layerwise, checking as it goes (--verify-swaps on a layer-by-layer swap-in): once layer l
  // is done, on_layer_checked(l, sums) gets the checksums of `ids` in that layer's targets
  // (sums[t * ids.size() + i] for its t-th target, as device_checksums orders them), in layer
  // order, so the caller can hold back reporting a layer until it checked it. The default sums
  // each layer with device_checksums once its copy is done; CUDA sums in the layer's own copy
  // kernel (kernel mode) or with a checksum kernel right behind it on the stream. Thread-safe.
  using CheckedLayer = std::function<void(std::uint32_t layer, std::span<const std::uint64_t> sums)>;
  virtual Status<DeviceErrc> copy_layerwise_checked(Direction dir, const kernels::CopyPlan& plan,
                                                    std::span<const kernels::CopyTarget> targets,
                                                    std::size_t targets_per_layer, std::span<const std::int32_t> ids,
                                                    const LayerCallback& on_layer_enqueued,
                                                    const CheckedLayer& on_layer_checked);

  // The monotonic time (ns) since which the oldest copy now running on a lane has been running,
  // or 0 when every lane is idle or waiting for an engine's event. A copy that never finishes
  // (a device that stopped) shows here; the daemon's watchdog acts on it. Any thread.
  virtual std::int64_t busy_since_ns() const { return 0; }

  // Interprocess handles (cudaIpcEventHandle_t) of the events recorded after each layer of a
  // layer-by-layer copy to the device, for the engine's compute stream; empty on the host backend.
  virtual Result<std::vector<std::array<std::uint8_t, proto::kHandleBytes>>, DeviceErrc> export_layer_events(
      std::uint32_t layers) = 0;

  // Layout transform for the storage tier (see kvtd/kernels/layout.h): device tensors <-> a
  // block-first staging buffer in host memory from alloc_host.
  virtual Status<DeviceErrc> gather_to_staging(std::span<const kernels::LayerTensor> tensors,
                                               std::span<const std::int32_t> ids, std::byte* staging) = 0;
  virtual Status<DeviceErrc> scatter_from_staging(std::span<const kernels::LayerTensor> tensors,
                                                  std::span<const std::int32_t> ids, const std::byte* staging) = 0;

  // Whether the CPU can read the mapped device tensors in place (the host backend: they are
  // shared memory). Then storage writes take their bytes straight from the tensors; else they
  // go through pinned staging (gather_to_staging).
  virtual bool tensors_host_accessible() const { return false; }
  // True once a call met a sticky (context-poisoning) error: nothing this process enqueues will
  // run again. The daemon stops serving and exits for a restart. Any thread.
  virtual bool broken() const { return false; }
};

// Device memory owned by the backend, and plain transfers to and from it: `kvtd selftest` only.
class SelfTestDevice {
 public:
  virtual ~SelfTestDevice() = default;
  virtual Result<std::byte*, DeviceErrc> alloc_device(std::size_t bytes) = 0;
  virtual Status<DeviceErrc> write_device(std::byte* dst, const std::byte* src, std::size_t bytes) = 0;
  virtual Status<DeviceErrc> read_device(std::byte* dst, const std::byte* src, std::size_t bytes) = 0;
  // This process's own device memory (context, streams, allocations) in words, as the driver
  // reports it; "" for a backend without a device.
  virtual std::string device_footprint() { return ""; }
};

class DeviceBackend : public TensorMapper, public HostMemory, public CopyEngine, public SelfTestDevice {
 public:
  virtual const char* name() const = 0;
};

// Host memory from HostMemory::alloc_host, returned to the backend when the buffer ends (a
// task runner is made per session and per weight update: what it takes must go back, or a
// daemon serving for weeks grows by its staging every time). Ownership: owns the memory; the
// backend must outlive it. Movable, not copyable. Not thread-safe (a value).
class HostBuffer {
 public:
  HostBuffer() = default;
  static Result<HostBuffer, DeviceErrc> allocate(HostMemory& backend, std::size_t bytes) {
    KVTD_ASSIGN_OR_RETURN(std::byte* p, backend.alloc_host(bytes));
    return HostBuffer(&backend, p, bytes);
  }
  HostBuffer(HostBuffer&& o) noexcept : backend_(o.backend_), data_(o.data_), size_(o.size_) { o.data_ = nullptr; }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      backend_ = o.backend_;
      data_ = o.data_;
      size_ = o.size_;
      o.data_ = nullptr;
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { reset(); }

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  void reset() {
    if (data_ != nullptr) backend_->free_host(data_);
    data_ = nullptr;
  }

 private:
  HostBuffer(HostMemory* b, std::byte* p, std::size_t n) : backend_(b), data_(p), size_(n) {}
  HostMemory* backend_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

std::unique_ptr<DeviceBackend> make_host_backend();
// Fails with kUnavailable and the reason when CUDA is not compiled in or no device/driver exists,
// or when `mode` is kBatch and this toolkit has no cudaMemcpyBatchAsync.
// `copy_batch_max` caps the copies of one cudaMemcpyBatchAsync call (batch mode): a task's are
// enqueued in calls of at most that many. `copy_wait_spin_us`: a copy lane polls for its copy's
// end in a window this wide around when it should end, sleeping on the host before it, rather
// than sleeping in the driver until the device wakes it (0: the driver's wait alone).
Result<std::unique_ptr<DeviceBackend>, DeviceErrc> make_cuda_backend(int device_id,
                                                                     ScatterMode mode = ScatterMode::kKernelAllLayers,
                                                                     std::size_t copy_batch_max = 4096,
                                                                     std::uint32_t copy_wait_spin_us = 0);
bool cuda_compiled_in();
// Whether the CUDA backend runs on cudasim, the CPU stand-in of the CUDA runtime (test builds).
bool cuda_stand_in();

}  // namespace kvtd::daemon
