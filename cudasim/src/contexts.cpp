// The driver API's contexts, as far as kvtd's Python client uses them: one primary context per
// device, a per-thread stack of current contexts, and the rule that driver calls on memory need
// one (CUDA_ERROR_INVALID_CONTEXT otherwise). The runtime makes the primary context current on
// a thread's first runtime call (enter()), so only a thread that never made one sees the error:
// FastDeploy's transfer threads registering torch tensors did, on an H100 (2026-11-28).
#include <vector>

#include "state.h"

namespace cudasim {
namespace {

constexpr int kMaxDevices = 16;
// A primary context's handle: the address of its slot (never dereferenced by callers).
struct PrimaryContext {
  std::atomic<int> retained{0};
};
PrimaryContext g_primary[kMaxDevices];

thread_local std::vector<CUcontext> tl_contexts;  // the thread's stack, current on top

CUcontext primary_of(int device) { return reinterpret_cast<CUcontext>(&g_primary[device]); }

bool is_context(CUcontext c) {
  for (int d = 0; d < kMaxDevices; ++d)
    if (c == primary_of(d)) return true;
  return false;
}

}  // namespace

void make_primary_context_current() {
  if (tl_contexts.empty()) {
    const int d = current_device();
    tl_contexts.push_back(primary_of(d >= 0 && d < kMaxDevices ? d : 0));
  }
}

bool has_current_context() { return !tl_contexts.empty(); }

}  // namespace cudasim

using namespace cudasim;

extern "C" {

CUresult cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= device_count() || ordinal >= kMaxDevices) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice device) {
  if (!ctx) return CUDA_ERROR_INVALID_VALUE;
  if (device < 0 || device >= device_count() || device >= kMaxDevices) return CUDA_ERROR_INVALID_DEVICE;
  g_primary[device].retained.fetch_add(1);
  *ctx = primary_of(device);
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice device) {  // cuda.h maps it to cuDevicePrimaryCtxRelease_v2
  if (device < 0 || device >= kMaxDevices) return CUDA_ERROR_INVALID_DEVICE;
  int n = g_primary[device].retained.load();
  while (n > 0 && !g_primary[device].retained.compare_exchange_weak(n, n - 1)) {
  }
  return n > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuCtxGetCurrent(CUcontext* ctx) {
  if (!ctx) return CUDA_ERROR_INVALID_VALUE;
  *ctx = tl_contexts.empty() ? nullptr : tl_contexts.back();
  return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext ctx) {  // cuCtxPushCurrent_v2
  if (!is_context(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  tl_contexts.push_back(ctx);
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent(CUcontext* ctx) {  // cuCtxPopCurrent_v2
  if (tl_contexts.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx) *ctx = tl_contexts.back();
  tl_contexts.pop_back();
  return CUDA_SUCCESS;
}

}  // extern "C"
