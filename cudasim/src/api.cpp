// The stand-in's runtime API for devices, streams and errors (declared by the toolkit's own
// cuda_runtime_api.h), over the core in runtime.cpp.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cuda_runtime.h"
#include "kvtd/base/mutex.h"
#include "kvtd/cudasim/control.h"
#include "state.h"

using namespace cudasim;

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t s = sticky_error();
  if (s != cudaSuccess) return s;  // sticky: never reset
  return take_last_error();
}

cudaError_t cudaPeekAtLastError(void) {
  const cudaError_t s = sticky_error();
  return s != cudaSuccess ? s : peek_last_error();
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return fail(cudaErrorInvalidValue);
  if (const cudaError_t e = enter("cudaGetDeviceCount"); e != cudaSuccess) return e;
  *count = device_count();
  return device_count() > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
  if (const cudaError_t e = enter("cudaSetDevice"); e != cudaSuccess) return e;
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  set_current_device(device);
  return cudaSuccess;
}

cudaError_t cudaSetDeviceFlags(unsigned int flags) {
  if (const cudaError_t e = enter("cudaSetDeviceFlags"); e != cudaSuccess) return e;
  const unsigned known = cudaDeviceScheduleMask | cudaDeviceMapHost | cudaDeviceLmemResizeToMax;
  if ((flags & ~known) != 0) return fail(cudaErrorInvalidValue);
  const unsigned schedule = flags & cudaDeviceScheduleMask;
  if (schedule != cudaDeviceScheduleAuto && schedule != cudaDeviceScheduleSpin && schedule != cudaDeviceScheduleYield &&
      schedule != cudaDeviceScheduleBlockingSync)
    return fail(cudaErrorInvalidValue);
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (!device) return fail(cudaErrorInvalidValue);
  *device = current_device();
  return cudaSuccess;
}

cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device) {
  if (const cudaError_t e = enter("cudaDeviceGetPCIBusId"); e != cudaSuccess) return e;
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  if (!bus_id || len < 13) return fail(cudaErrorInvalidValue);
  std::snprintf(bus_id, static_cast<std::size_t>(len), "0000:%02X:00.0", 0x17 + device);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (const cudaError_t e = enter("cudaDeviceGetAttribute"); e != cudaSuccess) return e;
  if (!value) return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrCanUseHostPointerForRegisteredMem:
      // KVTD_CUDASIM_NO_HOST_POINTERS=1: a device whose kernels need cudaHostGetDevicePointer.
      *value = std::getenv("KVTD_CUDASIM_NO_HOST_POINTERS") ? 0 : 1;
      return cudaSuccess;
    case cudaDevAttrUnifiedAddressing:
    case cudaDevAttrIpcEventSupport: *value = 1; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = 108; return cudaSuccess;
    case cudaDevAttrComputeMode:  // KVTD_CUDASIM_COMPUTE_MODE: a cudaComputeMode (default 0)
      *value = std::getenv("KVTD_CUDASIM_COMPUTE_MODE") ? std::atoi(std::getenv("KVTD_CUDASIM_COMPUTE_MODE")) : 0;
      return cudaSuccess;
    default: return fail(cudaErrorInvalidValue);
  }
}

cudaError_t cudaDeviceSynchronize(void) {
  if (const cudaError_t e = enter("cudaDeviceSynchronize"); e != cudaSuccess) return e;
  drain_all_streams();
  return fail(sticky_error());
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (const cudaError_t e = enter("cudaStreamCreateWithFlags"); e != cudaSuccess) return e;
  if (!stream || (flags & ~static_cast<unsigned>(cudaStreamNonBlocking)) != 0) return fail(cudaErrorInvalidValue);
  auto* s = new CUstream_st;
  s->flags = flags;
  start_stream(s);
  *stream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (const cudaError_t e = enter("cudaStreamDestroy"); e != cudaSuccess && e != sticky_error()) return e;
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  if (!forget_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  // CUDA returns at once and releases the stream once its work completed; the worker finishes
  // the queue before it exits, so joining here keeps that order.
  {
    MutexLock g(s->mu);
    s->stop = true;
  }
  s->cv.notify_all();
  s->worker.join();
  delete s;
  return fail(sticky_error());
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  if (const cudaError_t e = enter("cudaStreamQuery"); e != cudaSuccess) return e;
  if (const cudaError_t e = sticky_error(); e != cudaSuccess) return fail(e);
  // Not an error: cudaErrorNotReady is not recorded as the last error.
  return stream_idle(s) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (const cudaError_t e = enter("cudaStreamSynchronize"); e != cudaSuccess) return e;
  drain(s);
  return fail(sticky_error());
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
#define KVTD_CUDASIM_NAME(x) \
  case x: return #x;
    KVTD_CUDASIM_NAME(cudaSuccess)
    KVTD_CUDASIM_NAME(cudaErrorInvalidValue)
    KVTD_CUDASIM_NAME(cudaErrorMemoryAllocation)
    KVTD_CUDASIM_NAME(cudaErrorInvalidConfiguration)
    KVTD_CUDASIM_NAME(cudaErrorInvalidPitchValue)
    KVTD_CUDASIM_NAME(cudaErrorInvalidDevicePointer)
    KVTD_CUDASIM_NAME(cudaErrorInvalidMemcpyDirection)
    KVTD_CUDASIM_NAME(cudaErrorNoDevice)
    KVTD_CUDASIM_NAME(cudaErrorInvalidDevice)
    KVTD_CUDASIM_NAME(cudaErrorMapBufferObjectFailed)
    KVTD_CUDASIM_NAME(cudaErrorInvalidResourceHandle)
    KVTD_CUDASIM_NAME(cudaErrorNotReady)
    KVTD_CUDASIM_NAME(cudaErrorIllegalAddress)
    KVTD_CUDASIM_NAME(cudaErrorLaunchTimeout)
    KVTD_CUDASIM_NAME(cudaErrorHostMemoryAlreadyRegistered)
    KVTD_CUDASIM_NAME(cudaErrorHostMemoryNotRegistered)
    KVTD_CUDASIM_NAME(cudaErrorMisalignedAddress)
    KVTD_CUDASIM_NAME(cudaErrorLaunchFailure)
    KVTD_CUDASIM_NAME(cudaErrorNotSupported)
    KVTD_CUDASIM_NAME(cudaErrorUnknown)
#undef KVTD_CUDASIM_NAME
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorMapBufferObjectFailed: return "mapping of buffer object failed";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchTimeout: return "the launch timed out and was terminated";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    default: return "unrecognized error code";
  }
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version,
                                             unsigned long long flags, cudaDriverEntryPointQueryResult* status) {
  if (const cudaError_t e = enter("cudaGetDriverEntryPointByVersion"); e != cudaSuccess) return e;
  if (!symbol || !fn || version < 3020 || (flags & ~static_cast<unsigned long long>(cudaEnablePerThreadDefaultStream)) != 0)
    return fail(cudaErrorInvalidValue);
  // Only what kvtd asks for; any other symbol is "not found" (success, null pointer), as CUDA
  // answers for a symbol this driver lacks.
  *fn = std::strcmp(symbol, "cuMemGetAddressRange") == 0 ? reinterpret_cast<void*>(&cudasim_cuMemGetAddressRange)
                                                          : nullptr;
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

}  // extern "C"
