#include "device/cuda/cuda_check.h"

namespace kvtd::daemon::cuda {

std::string cuda_text(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

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

DeviceErrc errc_of(cudaError_t e, DeviceErrc otherwise) {
  if (!sticky(e)) return otherwise;
  g_context_lost.store(true, std::memory_order_release);
  return DeviceErrc::kContextLost;
}

}  // namespace kvtd::daemon::cuda
