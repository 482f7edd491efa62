// The stand-in's memory: device allocations in shared memory files (memfd) that another process
// opens through the 64-byte IPC handle (pid + descriptor + size: the allocation dies with its
// process, as on a GPU), pinned host memory, and the copies (by kind, checked against what each
// pointer really is; cudaMemcpyDefault for anything).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "state.h"

namespace cudasim {
namespace {

struct Range {
  std::size_t bytes = 0;
  Space space = Space::kUnknown;
  int fd = -1;            // device memory: the memfd behind it
  bool imported = false;  // opened from another process's handle
  bool owned_map = false; // we mmap'ed it (device memory, cudaHostAlloc)
  int refs = 1;           // imported: opens of the same handle
  std::uint64_t id = 0;   // imported: the exporter's allocation id
  std::int32_t pid = 0;   // imported: the exporter (ids are per process: two exporters share them)
};

Mutex g_mu;
std::map<std::uintptr_t, Range> g_ranges GUARDED_BY(g_mu);  // by base address
std::uint64_t g_next_id GUARDED_BY(g_mu) = 1;

constexpr std::uint32_t kMemHandleMagic = 0x4D454D43;  // "CMEM"

struct MemHandleBytes {
  std::uint32_t magic;
  std::int32_t pid;
  std::int32_t fd;
  std::uint32_t reserved;
  std::uint64_t bytes;
  std::uint64_t id;
};
static_assert(sizeof(MemHandleBytes) <= sizeof(cudaIpcMemHandle_t));

// A copy's two sides, as the device operation running it touches them.
void open_copy_sides(void* dst, const void* src, std::size_t dst_bytes, std::size_t src_bytes) {
  open_for_device_work(dst, dst_bytes);
  open_for_device_work(src, src_bytes);
}

std::string memfd_name(std::uint64_t id) { return "cudasim_device_" + std::to_string(id); }

// The range holding [p, p + n), or end().
std::map<std::uintptr_t, Range>::iterator find_locked(const void* p, std::size_t n) REQUIRES(g_mu) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = g_ranges.upper_bound(a);
  if (it == g_ranges.begin()) return g_ranges.end();
  --it;
  if (a + n > it->first + it->second.bytes || a + n < a) return g_ranges.end();
  return it;
}

// KVTD_CUDASIM_PIN_MBPS (read per call): a registration takes bytes / this many MB/s, as pinning
// takes time per page on a machine (an H100 machine pinned MAP_SHARED memory at 3-4 GB/s), so a
// test can watch a pool being pinned; unset or 0: at once. Calls on several threads overlap.
void pin_time(std::size_t bytes) {
  const char* v = std::getenv("KVTD_CUDASIM_PIN_MBPS");
  const double mbps = v != nullptr ? std::strtod(v, nullptr) : 0.0;
  if (mbps > 0) std::this_thread::sleep_for(std::chrono::duration<double>(static_cast<double>(bytes) / (mbps * 1e6)));
}

// KVTD_CUDASIM_HOST_REGISTER_MAX bytes (read per call) or 512 GiB.
std::size_t host_register_cap() {
  const char* v = std::getenv("KVTD_CUDASIM_HOST_REGISTER_MAX");
  return v != nullptr ? static_cast<std::size_t>(std::strtoull(v, nullptr, 10)) : std::size_t{512} << 30;
}

// KVTD_CUDASIM_BATCH_MAX (read per call) or 16,384 copies.
std::size_t batch_copy_cap() {
  const char* v = std::getenv("KVTD_CUDASIM_BATCH_MAX");
  return v != nullptr ? static_cast<std::size_t>(std::strtoull(v, nullptr, 10)) : 16384;
}

cudaError_t check_kind(const void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  const Space d = space_of(dst, bytes), s = space_of(src, bytes);
  const bool dd = d == Space::kDevice, sd = s == Space::kDevice;
  switch (kind) {
    case cudaMemcpyHostToHost: return !dd && !sd ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyHostToDevice: return dd && !sd ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToHost: return !dd && sd ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToDevice: return dd && sd ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDefault: return cudaSuccess;  // unified addressing: any pointers
  }
  return cudaErrorInvalidMemcpyDirection;
}

}  // namespace

Space space_of(const void* p, std::size_t n) {
  MutexLock g(g_mu);
  auto it = find_locked(p, n);
  return it == g_ranges.end() ? Space::kUnknown : it->second.space;
}

Space range_of(const void* p, std::size_t n, std::uintptr_t* lo, std::uintptr_t* hi) {
  MutexLock g(g_mu);
  auto it = find_locked(p, n);
  if (it == g_ranges.end()) return Space::kUnknown;
  *lo = it->first;
  *hi = it->first + it->second.bytes;
  return it->second.space;
}

}  // namespace cudasim

using namespace cudasim;

extern "C" {

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (const cudaError_t e = enter("cudaMalloc"); e != cudaSuccess) return e;
  if (!ptr) return fail(cudaErrorInvalidValue);
  if (bytes == 0) {
    *ptr = nullptr;
    return cudaSuccess;
  }
  std::uint64_t id = 0;
  {
    MutexLock g(g_mu);
    id = g_next_id++;
  }
  // The name carries the allocation id: an opener checks it, so a stale handle whose descriptor
  // number was reused never maps another object.
  const int fd = memfd_create(memfd_name(id).c_str(), MFD_CLOEXEC);
  void* p = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0)
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    if (fd >= 0) close(fd);
    return fail(cudaErrorMemoryAllocation);
  }
  MutexLock g(g_mu);
  Range r;
  r.bytes = bytes;
  r.space = Space::kDevice;
  r.fd = fd;
  r.owned_map = true;
  r.id = id;
  seal_device_range(p, bytes);
  g_ranges[reinterpret_cast<std::uintptr_t>(p)] = r;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (const cudaError_t e = enter("cudaFree"); e != cudaSuccess && e != sticky_error()) return e;
  if (!ptr) return cudaSuccess;
  drain_all_streams();  // cudaFree synchronises the device
  MutexLock g(g_mu);
  auto it = g_ranges.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == g_ranges.end() || it->second.space != Space::kDevice || it->second.imported)
    return fail(cudaErrorInvalidDevicePointer);
  forget_device_range(ptr);
  munmap(ptr, it->second.bytes);
  close(it->second.fd);
  g_ranges.erase(it);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int flags) {
  if (const cudaError_t e = enter("cudaHostAlloc"); e != cudaSuccess) return e;
  const unsigned known = cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined;
  if (!ptr || (flags & ~known) != 0) return fail(cudaErrorInvalidValue);
  void* p = mmap(nullptr, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
  MutexLock g(g_mu);
  Range r;
  r.bytes = bytes ? bytes : 1;
  r.space = Space::kPinnedHost;
  r.owned_map = true;
  g_ranges[reinterpret_cast<std::uintptr_t>(p)] = r;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (const cudaError_t e = enter("cudaFreeHost"); e != cudaSuccess && e != sticky_error()) return e;
  if (!ptr) return cudaSuccess;
  MutexLock g(g_mu);
  auto it = g_ranges.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == g_ranges.end() || it->second.space != Space::kPinnedHost || !it->second.owned_map)
    return fail(cudaErrorInvalidValue);
  munmap(ptr, it->second.bytes);
  g_ranges.erase(it);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void* ptr, size_t bytes, unsigned int flags) {
  if (const cudaError_t e = enter("cudaHostRegister"); e != cudaSuccess) return e;
  const unsigned known = cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterIoMemory |
                         cudaHostRegisterReadOnly;
  if (!ptr || bytes == 0 || (flags & ~known) != 0) return fail(cudaErrorInvalidValue);
  // Drivers refuse one registration of 512 GiB or more (vllm#51080); the cap can be lowered so a
  // test can show a caller registers in pieces.
  if (bytes >= host_register_cap()) return fail(cudaErrorInvalidValue);
  // CUDA pins pages: a range that is not wholly mapped is refused, and two registrations may not
  // share a page.
  const std::uintptr_t page = 4096;
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  const std::uintptr_t first = a & ~(page - 1), end = (a + bytes + page - 1) & ~(page - 1);
  if (msync(reinterpret_cast<void*>(first), end - first, MS_ASYNC) != 0) return fail(cudaErrorInvalidValue);
  pin_time(bytes);
  MutexLock g(g_mu);
  auto it = g_ranges.lower_bound(first);
  if (it != g_ranges.end() && it->first < end) return fail(cudaErrorHostMemoryAlreadyRegistered);
  if (it != g_ranges.begin() && ((std::prev(it)->first + std::prev(it)->second.bytes + page - 1) & ~(page - 1)) > first)
    return fail(cudaErrorHostMemoryAlreadyRegistered);
  Range r;
  r.bytes = bytes;
  r.space = Space::kPinnedHost;
  g_ranges[a] = r;
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* ptr) {
  if (const cudaError_t e = enter("cudaHostUnregister"); e != cudaSuccess && e != sticky_error()) return e;
  MutexLock g(g_mu);
  auto it = g_ranges.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == g_ranges.end() || it->second.space != Space::kPinnedHost || it->second.owned_map)
    return fail(cudaErrorHostMemoryNotRegistered);
  g_ranges.erase(it);
  return cudaSuccess;
}

cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned int flags) {
  if (const cudaError_t e = enter("cudaHostGetDevicePointer"); e != cudaSuccess) return e;
  if (!dev || flags != 0) return fail(cudaErrorInvalidValue);
  if (space_of(host, 1) != Space::kPinnedHost) return fail(cudaErrorInvalidValue);
  *dev = mapped_host_address(host);  // unified addressing: the same address, unless the device says not
  return cudaSuccess;
}

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* dev) {
  if (const cudaError_t e = enter("cudaIpcGetMemHandle"); e != cudaSuccess) return e;
  if (!handle) return fail(cudaErrorInvalidValue);
  MutexLock g(g_mu);
  // Any pointer into an allocation: the handle names the allocation (its base), as CUDA's does,
  // so a caller that registers an interior pointer without its offset opens the wrong bytes here
  // too (torch's caching allocator hands out interior pointers).
  auto it = find_locked(dev, 1);
  if (it == g_ranges.end() || it->second.space != Space::kDevice || it->second.imported)
    return fail(cudaErrorInvalidValue);
  std::memset(handle, 0, sizeof *handle);
  const MemHandleBytes b{kMemHandleMagic, static_cast<std::int32_t>(getpid()), it->second.fd, 0, it->second.bytes,
                         it->second.id};
  std::memcpy(handle, &b, sizeof b);
  return cudaSuccess;
}

cudaError_t cudaIpcOpenMemHandle(void** ptr, cudaIpcMemHandle_t handle, unsigned int flags) {
  if (const cudaError_t e = enter("cudaIpcOpenMemHandle"); e != cudaSuccess) return e;
  if (!ptr || flags != cudaIpcMemLazyEnablePeerAccess) return fail(cudaErrorInvalidValue);
  MemHandleBytes b{};
  std::memcpy(&b, &handle, sizeof b);
  if (b.magic != kMemHandleMagic || b.bytes == 0) return fail(cudaErrorInvalidResourceHandle);
  if (b.pid == getpid()) return fail(cudaErrorInvalidResourceHandle);  // not from this process
  {
    MutexLock g(g_mu);
    for (auto& [base, r] : g_ranges)
      if (r.imported && r.id == b.id && r.pid == b.pid && r.fd >= 0) {  // opened already: same pointer
        ++r.refs;
        *ptr = reinterpret_cast<void*>(base);
        return cudaSuccess;
      }
  }
  const std::string path = "/proc/" + std::to_string(b.pid) + "/fd/" + std::to_string(b.fd);
  char target[256] = {0};
  const ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
  const std::string want = "/memfd:" + memfd_name(b.id) + " ";
  if (n <= 0 || std::string(target, static_cast<std::size_t>(n)).rfind(want, 0) != 0)
    return fail(cudaErrorInvalidResourceHandle);  // the exporter is gone or freed it
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return fail(cudaErrorInvalidResourceHandle);
  void* p = mmap(nullptr, b.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return fail(cudaErrorMapBufferObjectFailed);
  }
  MutexLock g(g_mu);
  Range r;
  r.bytes = b.bytes;
  r.space = Space::kDevice;
  r.fd = fd;
  r.imported = true;
  r.owned_map = true;
  r.id = b.id;
  r.pid = b.pid;
  seal_device_range(p, b.bytes);
  g_ranges[reinterpret_cast<std::uintptr_t>(p)] = r;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void* ptr) {
  if (const cudaError_t e = enter("cudaIpcCloseMemHandle"); e != cudaSuccess && e != sticky_error()) return e;
  MutexLock g(g_mu);
  auto it = g_ranges.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == g_ranges.end() || !it->second.imported) return fail(cudaErrorInvalidValue);
  if (--it->second.refs > 0) return cudaSuccess;
  forget_device_range(ptr);
  munmap(ptr, it->second.bytes);
  close(it->second.fd);
  g_ranges.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, enum cudaMemcpyKind kind) {
  if (const cudaError_t e = enter("cudaMemcpy"); e != cudaSuccess) return e;
  if (const cudaError_t e = check_kind(dst, src, bytes, kind); e != cudaSuccess) {
    (void)take_async_fault();
    return fail(e);
  }
  // The legacy default stream: after every blocking stream's earlier work; not ordered with
  // cudaStreamNonBlocking streams (as on a GPU).
  return submit(nullptr, [=] {
    open_copy_sides(dst, src, bytes, bytes);
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  });
}

// On the legacy default stream, like cudaMemcpy; only device memory (CUDA: invalid value else).
cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (const cudaError_t e = enter("cudaMemset"); e != cudaSuccess) return e;
  if (bytes == 0) return cudaSuccess;
  if (space_of(dst, bytes) != Space::kDevice) return fail(cudaErrorInvalidValue);
  return submit(nullptr, [=] {
    open_for_device_work(dst, bytes);
    std::memset(dst, value, bytes);
    return cudaSuccess;
  });
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, enum cudaMemcpyKind kind, cudaStream_t s) {
  if (const cudaError_t e = enter("cudaMemcpyAsync"); e != cudaSuccess) return e;
  if (const cudaError_t e = check_kind(dst, src, bytes, kind); e != cudaSuccess) {
    (void)take_async_fault();
    return fail(e);
  }
  const cudaError_t e = submit(s, [=] {
    open_copy_sides(dst, src, bytes, bytes);
    std::memmove(dst, src, bytes);
    return cudaSuccess;
  });
  return s == nullptr ? e : cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              enum cudaMemcpyKind kind, cudaStream_t s) {
  if (const cudaError_t e = enter("cudaMemcpy2DAsync"); e != cudaSuccess) return e;
  if (width > dpitch || width > spitch) {
    (void)take_async_fault();
    return fail(cudaErrorInvalidPitchValue);
  }
  const std::size_t dspan = height ? dpitch * (height - 1) + width : 0, sspan = height ? spitch * (height - 1) + width : 0;
  if (height != 0) {
    const cudaError_t e = check_kind(dst, src, std::min(dspan, sspan), kind);
    if (e != cudaSuccess || check_kind(dst, src, width, kind) != cudaSuccess) {
      (void)take_async_fault();
      return fail(cudaErrorInvalidValue);
    }
  }
  return submit(s, [=] {
    open_copy_sides(dst, src, dspan, sspan);
    for (std::size_t row = 0; row < height; ++row)
      std::memmove(static_cast<char*>(dst) + row * dpitch, static_cast<const char*>(src) + row * spitch, width);
    return cudaSuccess;
  });
}

cudaError_t cudaMemcpyBatchAsync(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                                 struct cudaMemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs,
                                 cudaStream_t s) {
  if (const cudaError_t e = enter("cudaMemcpyBatchAsync"); e != cudaSuccess) return e;
  auto bad = [] {
    (void)take_async_fault();
    return fail(cudaErrorInvalidValue);
  };
  // CUDA 13: not on the legacy stream; attribute i applies from attrs_idxs[i] (the first is 0,
  // increasing, below count) to the next one.
  if (s == nullptr || s == cudaStreamLegacy || count == 0 || !dsts || !srcs || !sizes || !attrs || !attrs_idxs ||
      num_attrs == 0 || num_attrs > count || attrs_idxs[0] != 0)
    return bad();
  // Drivers fail (crash or hang, vllm#49276) on one batch of ~52K copies; the stand-in refuses
  // far earlier so that a caller that does not split its batches fails here, not on a GPU.
  if (count > batch_copy_cap()) return bad();
  for (std::size_t i = 1; i < num_attrs; ++i)
    if (attrs_idxs[i] <= attrs_idxs[i - 1] || attrs_idxs[i] >= count) return bad();
  for (std::size_t i = 0; i < num_attrs; ++i)
    if (attrs[i].srcAccessOrder == cudaMemcpySrcAccessOrderInvalid ||
        (attrs[i].flags & ~static_cast<unsigned>(cudaMemcpyFlagPreferOverlapWithCompute)) != 0)
      return bad();
  std::vector<void*> d(dsts, dsts + count);
  std::vector<const void*> sv(srcs, srcs + count);
  std::vector<std::size_t> n(sizes, sizes + count);
  // Copies within a batch have no order among themselves: run them back to front, so a caller
  // that relied on an order would see it broken here first.
  return submit(s, [d = std::move(d), sv = std::move(sv), n = std::move(n)] {
    for (std::size_t i = d.size(); i-- > 0;) {
      open_copy_sides(d[i], sv[i], n[i], n[i]);
      std::memmove(d[i], sv[i], n[i]);
    }
    return cudaSuccess;
  });
}

// An 80 GiB device, less what this process allocated (other processes' allocations are not seen).
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  if (const cudaError_t e = enter("cudaMemGetInfo"); e != cudaSuccess) return e;
  if (!free_bytes || !total_bytes) return fail(cudaErrorInvalidValue);
  const std::size_t total = std::size_t{80} << 30;
  std::size_t used = 0;
  MutexLock g(g_mu);
  for (const auto& [base, r] : g_ranges)
    if (r.space == Space::kDevice && !r.imported) used += r.bytes;
  *total_bytes = total;
  *free_bytes = used < total ? total - used : 0;
  return cudaSuccess;
}

// Driver API, reached through cudaGetDriverEntryPointByVersion (api.cpp) as kvtd does: the base
// and size of the allocation holding `dptr`, opened IPC mappings included.
CUresult cudasim_cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr dptr) {
  if (sticky_error() != cudaSuccess) return CUDA_ERROR_ILLEGAL_ADDRESS;
  MutexLock g(g_mu);
  auto it = find_locked(reinterpret_cast<const void*>(dptr), 1);
  if (it == g_ranges.end() || it->second.space != Space::kDevice) return CUDA_ERROR_NOT_FOUND;
  if (base) *base = static_cast<CUdeviceptr>(it->first);
  if (size) *size = it->second.bytes;
  return CUDA_SUCCESS;
}

// The two driver calls kvtd's Python client makes through ctypes (python/kvtd/tensors.py), as
// libcuda exports them, so its handle logic runs against the stand-in's allocations.
// Unlike the runtime, they need a current context on the calling thread (contexts.cpp).
CUresult cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr dptr) {
  if (!has_current_context()) return CUDA_ERROR_INVALID_CONTEXT;
  return cudasim_cuMemGetAddressRange(base, size, dptr);
}

CUresult cuIpcGetMemHandle(CUipcMemHandle* handle, CUdeviceptr dptr) {
  static_assert(sizeof(CUipcMemHandle) == sizeof(cudaIpcMemHandle_t));
  if (!has_current_context()) return CUDA_ERROR_INVALID_CONTEXT;
  if (!handle) return CUDA_ERROR_INVALID_VALUE;
  cudaIpcMemHandle_t h{};
  const cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(dptr));
  if (e != cudaSuccess) {
    (void)take_last_error();
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::memcpy(handle, &h, sizeof h);
  return CUDA_SUCCESS;
}

}  // extern "C"
