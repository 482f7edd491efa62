// cuda_check.h (daemon-internal, CUDA builds only) - one way to check a CUDA runtime call, the
// model being NCCL's checks.h: KVTD_CUDA_TRY returns the error as a value naming the call, and a
// context-poisoning (sticky) error marks the process's context lost for good.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "kvtd/daemon/device_backend.h"

namespace kvtd::daemon::cuda {

constexpr bool kHaveBatchCopy = CUDART_VERSION >= 13000;

// "what: cudaErrorName: its description".
std::string cuda_text(const char* what, cudaError_t e);

// Set once any call met a context-poisoning error: the CUDA context of this process is lost for
// good (every later call returns the same error), so the daemon must exit and be restarted.
extern std::atomic<bool> g_context_lost;

// Whether `e` is an MPS failure (805-810): the daemon's device access is gone for good.
bool mps_failure(cudaError_t e);

// Resets the calling thread's last-error slot and says whether an error survived the reset: a
// context-poisoning (sticky) error does, by the runtime's documented behaviour.
bool clear_and_check_sticky();

// What the failed call's error `e` means for the backend, called right after the failure on the
// failing thread: clears the last-error slot; a sticky error (it survives the clear) or an MPS
// failure marks the context lost (kContextLost), anything else is `otherwise`.
DeviceErrc errc_of(cudaError_t e, DeviceErrc otherwise = DeviceErrc::kCopyFailed);

// One macro for every runtime call (NCCL's checks.h style): on failure it clears the runtime's
// last error (inside errc_of) so the error of this task is not reported again by the launch
// check of the next, healthy one, and returns it as a value. Callers that enqueued work first
// drain their stream before passing the error on (see Lane::drain).
#define KVTD_CUDA_TRY(call)                                                              \
  do {                                                                                   \
    if (const cudaError_t kvtd_e_ = (call); kvtd_e_ != cudaSuccess) {                    \
      return make_error(errc_of(kvtd_e_), cuda_text(#call, kvtd_e_));                    \
    }                                                                                    \
  } while (0)

}  // namespace kvtd::daemon::cuda
