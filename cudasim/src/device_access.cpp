// device_access.cpp - what device code may touch, and when host code may not: kernel launches,
// the GPU's checks of every device-code access, and device memory sealed from host code.
//
// On a GPU, host code cannot load or store device memory (cudaMalloc'ed or IPC-opened): it
// faults. The stand-in's device is this CPU, so it keeps every device range PROT_NONE and opens a
// range only for the device operation (copy, memset, kernel) that touches it, sealing it again
// when the last such operation ends. A host dereference of device memory therefore takes SIGSEGV
// as on a GPU (unless it races device work on that very range: best effort, never a false
// alarm). Only touched ranges are opened, so the cost is a few mprotect calls per operation.
//
// Device code reaches pinned host memory by the address cudaHostGetDevicePointer gives. Where the
// device says CanUseHostPointerForRegisteredMem = 0 (KVTD_CUDASIM_NO_HOST_POINTERS=1) that is not
// the host address, and a kernel handed the raw host address faults: the stand-in's "mapped"
// address is the host address with bit 62 set (never a valid host address), which device-code
// accesses translate back.
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <vector>

#include "cuda_runtime.h"
#include "kvtd/base/mutex.h"
#include "state.h"

namespace cudasim {
namespace {

struct OpenRange {
  std::size_t bytes = 0;
  int holders = 0;  // device operations running now that touch it
};

Mutex g_access_mu;
std::map<std::uintptr_t, OpenRange> g_open GUARDED_BY(g_access_mu);  // by base address

// The device operation this thread runs now, and the ranges it opened.
thread_local bool tl_device_work = false;
thread_local std::vector<std::uintptr_t> tl_opened;

constexpr std::uintptr_t kMappedAliasBit = std::uintptr_t{1} << 62;

struct KernelFault {
  cudaError_t error;
};

// The last range a device-code access of this (worker) thread fell in, and the amount its
// addresses are translated by: most accesses of a kernel hit the same allocation, so the range
// maps are consulted once per allocation, not per access. Forgotten at every launch (an
// allocation freed in between must not stay accessible).
thread_local std::uintptr_t tl_access_lo = 0, tl_access_hi = 0, tl_access_delta = 0;

}  // namespace

bool no_host_pointers() { return std::getenv("KVTD_CUDASIM_NO_HOST_POINTERS") != nullptr; }

void* mapped_host_address(void* host) {
  return no_host_pointers() ? reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(host) | kMappedAliasBit)
                            : host;
}

void seal_device_range(void* base, std::size_t bytes) { (void)mprotect(base, bytes, PROT_NONE); }

void forget_device_range(void* base) {
  MutexLock g(g_access_mu);
  g_open.erase(reinterpret_cast<std::uintptr_t>(base));
}

void open_for_device_work(const void* p, std::size_t bytes) {
  if (!tl_device_work || p == nullptr) return;
  std::uintptr_t lo = 0, hi = 0;
  if (range_of(p, bytes == 0 ? 1 : bytes, &lo, &hi) != Space::kDevice) return;
  if (std::find(tl_opened.begin(), tl_opened.end(), lo) != tl_opened.end()) return;
  MutexLock g(g_access_mu);
  OpenRange& r = g_open[lo];
  if (r.holders++ == 0) {
    r.bytes = hi - lo;
    (void)mprotect(reinterpret_cast<void*>(lo), r.bytes, PROT_READ | PROT_WRITE);
  }
  tl_opened.push_back(lo);
}

cudaError_t run_device_work(const Op& op) {
  tl_device_work = true;
  const cudaError_t e = op();
  tl_device_work = false;
  MutexLock g(g_access_mu);
  for (const std::uintptr_t lo : tl_opened) {
    auto it = g_open.find(lo);
    if (it == g_open.end() || --it->second.holders > 0) continue;  // freed meanwhile, or still in use
    seal_device_range(reinterpret_cast<void*>(lo), it->second.bytes);
    g_open.erase(it);
  }
  tl_opened.clear();
  return e;
}

void* device_access(const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (bytes != 0 && (bytes & (bytes - 1)) == 0 && a % bytes != 0) throw KernelFault{cudaErrorMisalignedAddress};
  if (a >= tl_access_lo && a + bytes <= tl_access_hi) return reinterpret_cast<void*>(a - tl_access_delta);
  const bool mapped = (a & kMappedAliasBit) != 0;
  const std::uintptr_t host = a & ~kMappedAliasBit;
  std::uintptr_t lo = 0, hi = 0;
  const Space space = range_of(reinterpret_cast<const void*>(host), bytes, &lo, &hi);
  // Device memory by its own address; pinned host memory by the address the device maps it at.
  const bool ok = space == Space::kDevice ? !mapped : space == Space::kPinnedHost && mapped == no_host_pointers();
  if (!ok) throw KernelFault{cudaErrorIllegalAddress};
  if (space == Space::kDevice) open_for_device_work(reinterpret_cast<const void*>(host), bytes);
  tl_access_delta = a - host;
  tl_access_lo = lo + tl_access_delta;
  tl_access_hi = hi + tl_access_delta;
  return reinterpret_cast<void*>(host);
}

cudaError_t enqueue_launch(cudaStream_t stream, dim3 grid, dim3 block, std::vector<const void*> pointer_args,
                           std::function<void()> body) {
  if (const cudaError_t e = enter("cudaLaunchKernel"); e != cudaSuccess) return e;
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || grid.y > 65535 ||
      grid.z > 65535) {
    (void)take_async_fault();
    return fail(cudaErrorInvalidConfiguration);
  }
  return submit(stream, [grid, block, pointer_args = std::move(pointer_args), body = std::move(body)]() -> cudaError_t {
    // Tables a kernel indexes directly (ids, targets) arrive as pointer arguments.
    for (const void* p : pointer_args) open_for_device_work(p, 1);
    tl_grid_dim = grid;
    tl_block_dim = block;
    tl_access_lo = tl_access_hi = tl_access_delta = 0;
    try {
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            tl_block_idx = uint3{bx, by, bz};
            for (unsigned tz = 0; tz < block.z; ++tz)
              for (unsigned ty = 0; ty < block.y; ++ty)
                for (unsigned tx = 0; tx < block.x; ++tx) {
                  tl_thread_idx = uint3{tx, ty, tz};
                  body();
                }
          }
    } catch (const KernelFault& f) {
      return f.error;  // the kernel stops; the error breaks the context (sticky)
    }
    return cudaSuccess;
  });
}

}  // namespace cudasim
