#include "cuda/cuda_check.h"

namespace kvtd::daemon::cuda {

std::string cuda_text(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

std::atomic<bool> g_context_lost{false};

bool mps_failure(cudaError_t e) {
  // 805-810 (driver_types.h): the MPS server or the connection to it failed, or the server
  // terminated this client. None of them is recoverable inside this process.
  return e >= cudaErrorMpsConnectionFailed && e <= cudaErrorMpsClientTerminated;
}

bool clear_and_check_sticky() {
  // The runtime's documented behaviour for context-poisoning errors ("any further CUDA work will
  // return the same error", driver_types.h): cudaGetLastError cannot reset them. So: reset the
  // slot once; an error still there afterwards is the context's own. No hand-kept list of codes
  // to fall out of date with the next toolkit (the old one missed 226, 721, 810 and 911).
  (void)cudaGetLastError();
  return cudaGetLastError() != cudaSuccess;
}

DeviceErrc errc_of(cudaError_t e, DeviceErrc otherwise) {
  const bool lost = clear_and_check_sticky() || mps_failure(e);
  if (!lost) return otherwise;
  g_context_lost.store(true, std::memory_order_release);
  return DeviceErrc::kContextLost;
}

}  // namespace kvtd::daemon::cuda
