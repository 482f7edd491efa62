// The device room without the CUDA toolkit (chosen by CMake when KVTD_HAVE_CUDA is off): the
// host backend only; asking for CUDA names why it is not there.
#include "kvtd/daemon/device_backend.h"

namespace kvtd::daemon {

bool cuda_compiled_in() { return false; }
bool cuda_stand_in() { return false; }

Result<std::unique_ptr<DeviceBackend>, DeviceErrc> make_cuda_backend(int, ScatterMode, std::size_t, std::uint32_t) {
  return make_error(DeviceErrc::kUnavailable, "this kvtd was built without the CUDA toolkit; use --device-backend host");
}

}  // namespace kvtd::daemon
