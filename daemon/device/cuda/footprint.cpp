#include "cuda/footprint.h"

#include <dlfcn.h>
#include <unistd.h>

#include <vector>

namespace kvtd::daemon::cuda {
namespace {

// NVML's C ABI as nvml.h declares it (not shipped with the toolkit here; layout from NVIDIA's
// nvml.h, `typedef struct nvmlProcessInfo_st` used by nvmlDeviceGetComputeRunningProcesses_v3:
// pid, usedGpuMemory, gpuInstanceId, computeInstanceId).
struct NvmlProcessInfo {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};
using NvmlDevice = void*;
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlInsufficientSize = 7;
// NVML_VALUE_NOT_AVAILABLE: the driver does not say (WDDM, some MIG set-ups).
constexpr unsigned long long kNvmlValueNotAvailable = ~0ULL;

using InitFn = int (*)();
using ShutdownFn = int (*)();
using HandleByPciFn = int (*)(const char*, NvmlDevice*);
using ProcessesFn = int (*)(NvmlDevice, unsigned int*, NvmlProcessInfo*);

template <typename F>
F symbol(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

std::optional<std::uint64_t> own_entry(ProcessesFn processes, NvmlDevice dev) {
  std::vector<NvmlProcessInfo> infos(64);
  for (int attempt = 0; attempt < 3; ++attempt) {
    auto count = static_cast<unsigned int>(infos.size());
    const int rc = processes(dev, &count, infos.data());
    if (rc == kNvmlInsufficientSize) {  // more processes than room: count says how many
      infos.resize(count + 16);
      continue;
    }
    if (rc != kNvmlSuccess) return std::nullopt;
    const auto me = static_cast<unsigned int>(getpid());
    for (unsigned int i = 0; i < count && i < infos.size(); ++i)
      if (infos[i].pid == me && infos[i].used_gpu_memory != kNvmlValueNotAvailable) return infos[i].used_gpu_memory;
    return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::uint64_t> process_device_bytes(const std::string& pci_bus_id) {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return std::nullopt;
  auto init = symbol<InitFn>(lib, "nvmlInit_v2");
  auto shutdown = symbol<ShutdownFn>(lib, "nvmlShutdown");
  auto by_pci = symbol<HandleByPciFn>(lib, "nvmlDeviceGetHandleByPciBusId_v2");
  auto processes = symbol<ProcessesFn>(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
  std::optional<std::uint64_t> bytes;
  if (init && shutdown && by_pci && processes && init() == kNvmlSuccess) {
    NvmlDevice dev = nullptr;
    if (by_pci(pci_bus_id.c_str(), &dev) == kNvmlSuccess) bytes = own_entry(processes, dev);
    shutdown();
  }
  dlclose(lib);
  return bytes;
}

}  // namespace kvtd::daemon::cuda
