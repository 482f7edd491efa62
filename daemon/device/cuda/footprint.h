// footprint.h (daemon-internal, CUDA builds only) - how much device memory this process holds
// on a GPU (its context, streams and allocations): what the engine loses to the daemon.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace kvtd::daemon::cuda {

// This process's device memory on the GPU at `pci_bus_id` ("0000:17:00.0"), as the driver's
// NVML reports it (libnvidia-ml.so.1, loaded at run time: no build dependency). nullopt when
// NVML is absent (the stand-in, containers without it), or does not list this process (another
// PID namespace). Thread-safe; takes milliseconds: call at start, not per task.
std::optional<std::uint64_t> process_device_bytes(const std::string& pci_bus_id);

}  // namespace kvtd::daemon::cuda
