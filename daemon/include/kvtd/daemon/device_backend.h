// kvtd/daemon/device_backend.h - where the "device" tensors live and how plans are carried out.
//
// Two implementations: the host backend (device tensors are shared-memory objects made by the
// engine side; plans run with memcpy) and the CUDA backend (cudaIpcOpenMemHandle, pinned host
// memory, cudaMemcpyAsync for runs and a copy kernel for scattered blocks). Everything above
// this interface is the same code, which is how the daemon is tested without a GPU.
//
// Ownership: a backend owns every tensor mapping it opened and every host buffer it allocated;
// close_tensors() releases the mappings exactly once (also done by the destructor).
// Thread-safety: copy() may run concurrently for the two directions (each has its own stream);
// open/close/alloc are called from one thread while no copy runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "kvtd/kernels/copy_plan.h"
#include "kvtd/kernels/host_copy.h"
#include "kvtd/proto/expected.h"
#include "kvtd/proto/session.h"

namespace kvtd::daemon {

enum class DeviceErrc {
  kUnavailable,  // backend cannot run here (no driver, no device, not compiled in)
  kOpenFailed,   // a tensor handle could not be opened or is too small
  kAllocFailed,  // pinned host memory could not be allocated
  kCopyFailed,   // a copy failed (message carries the driver's error string)
};

enum class Direction { kToHost, kToDevice };

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual const char* name() const = 0;

  // Maps one registered tensor and returns the address of its first byte (handle base plus the
  // recorded offset). Opening the same handle twice maps it once.
  virtual Result<std::byte*, DeviceErrc> open_tensor(const proto::TensorDesc& desc) = 0;
  // Releases every mapping opened since the last call.
  virtual void close_tensors() = 0;

  // Host memory for the host pool (pinned for DMA on CUDA), zero-filled; freed by the backend.
  virtual Result<std::byte*, DeviceErrc> alloc_host(std::size_t bytes) = 0;

  // Carries out `plan` for every target, in the direction's stream, and returns when done.
  virtual Status<DeviceErrc> copy(Direction dir, const kernels::CopyPlan& plan,
                                  std::span<const kernels::CopyTarget> targets) = 0;
};

std::unique_ptr<DeviceBackend> make_host_backend();
// Fails with kUnavailable and the reason when CUDA is not compiled in or no device/driver exists.
Result<std::unique_ptr<DeviceBackend>, DeviceErrc> make_cuda_backend(int device_id);
bool cuda_compiled_in();

}  // namespace kvtd::daemon
