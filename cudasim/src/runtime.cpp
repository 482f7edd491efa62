// The stand-in's runtime: devices, errors (per-thread last error, process-wide sticky error),
// fault injection, streams with worker threads, events (also across processes) and launches.
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

namespace cudasim {
namespace {

thread_local cudaError_t tl_last_error = cudaSuccess;
thread_local int tl_device = 0;
thread_local cudaError_t tl_async_fault = cudaSuccess;  // set by enter(), taken by the enqueue
std::atomic<int> g_sticky{cudaSuccess};
std::atomic<std::uint32_t> g_op_delay_us{0};

struct Faults {
  Mutex mu;
  std::map<std::string, std::uint64_t> calls GUARDED_BY(mu);
  std::map<std::pair<std::string, std::uint64_t>, cudaError_t> planned GUARDED_BY(mu);
  Faults() {
    if (const char* us = std::getenv("KVTD_CUDASIM_OP_DELAY_US")) g_op_delay_us = static_cast<std::uint32_t>(std::atoi(us));
    if (const char* spec = std::getenv("KVTD_CUDASIM_FAULTS")) {
      // function:nth:code[,function:nth:code...]
      std::string s = spec;
      std::size_t at = 0;
      while (at < s.size()) {
        std::size_t end = s.find(',', at);
        if (end == std::string::npos) end = s.size();
        const std::string item = s.substr(at, end - at);
        const std::size_t c1 = item.find(':'), c2 = item.rfind(':');
        if (c1 != std::string::npos && c2 != c1) {
          planned[{item.substr(0, c1), std::strtoull(item.c_str() + c1 + 1, nullptr, 10)}] =
              static_cast<cudaError_t>(std::atoi(item.c_str() + c2 + 1));
        } else {
          std::fprintf(stderr, "cudasim: ignoring malformed KVTD_CUDASIM_FAULTS item '%s'\n", item.c_str());
        }
        at = end + 1;
      }
    }
  }
};

Faults& faults() {
  static Faults f;
  return f;
}

// Streams that exist (for the legacy stream's implicit synchronisation and cudaDeviceSynchronize).
Mutex g_streams_mu;
std::set<cudaStream_t> g_streams GUARDED_BY(g_streams_mu);

void worker_loop(cudaStream_t s) {
  MutexLock lk(s->mu);
  for (;;) {
    s->cv.wait(lk, [s]() REQUIRES(s->mu) { return s->stop || !s->queue.empty(); });
    if (s->queue.empty()) return;  // stopping and drained
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    s->running = true;
    lk.unlock();
    if (const auto us = std::max(g_op_delay_us.load(), s->delay_us.load()))
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    if (sticky_error() == cudaSuccess) {  // a broken context runs nothing more
      if (const cudaError_t e = op(); e != cudaSuccess) set_sticky(e);
    }
    lk.lock();
    s->running = false;
    s->cv.notify_all();
  }
}

}  // namespace

thread_local uint3 tl_thread_idx;
thread_local uint3 tl_block_idx;
thread_local dim3 tl_block_dim;
thread_local dim3 tl_grid_dim;

bool is_sticky(int e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure: return true;
    default: return false;
  }
}

cudaError_t fail(cudaError_t e) {
  if (e != cudaSuccess) tl_last_error = e;
  return e;
}

cudaError_t sticky_error() { return static_cast<cudaError_t>(g_sticky.load(std::memory_order_acquire)); }

void set_sticky(cudaError_t e) {
  int expected = cudaSuccess;
  g_sticky.compare_exchange_strong(expected, e, std::memory_order_acq_rel);  // the first one stays
}

cudaError_t enter(const char* function) {
  tl_async_fault = cudaSuccess;
  auto& f = faults();
  cudaError_t planned = cudaSuccess;
  {
    MutexLock g(f.mu);
    const std::uint64_t n = ++f.calls[function];
    if (auto it = f.planned.find({function, n}); it != f.planned.end()) planned = it->second;
  }
  if (const cudaError_t s = sticky_error(); s != cudaSuccess) return fail(s);
  if (planned == cudaSuccess) return cudaSuccess;
  if (is_sticky(planned)) {
    tl_async_fault = planned;  // raised when the work runs (or now, for a synchronous call)
    return cudaSuccess;
  }
  return fail(planned);
}

cudaError_t take_async_fault() {
  const cudaError_t e = tl_async_fault;
  tl_async_fault = cudaSuccess;
  return e;
}

int current_device() { return tl_device; }
// Read on every call, so a test can take the devices away.
int device_count() {
  const char* d = std::getenv("KVTD_CUDASIM_DEVICES");
  return d ? std::atoi(d) : 1;
}

cudaError_t submit(cudaStream_t s, Op op) {
  if (const cudaError_t fault = take_async_fault(); fault != cudaSuccess)
    op = [fault] { return fault; };  // the work never happens; the context breaks when it "runs"
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    drain_blocking_streams();
    if (sticky_error() == cudaSuccess)
      if (const cudaError_t e = op(); e != cudaSuccess) set_sticky(e);
    return fail(sticky_error());
  }
  {
    MutexLock g(s->mu);
    s->queue.push_back(std::move(op));
  }
  s->cv.notify_all();
  return cudaSuccess;
}

void drain(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return drain_blocking_streams();
  MutexLock lk(s->mu);
  s->cv.wait(lk, [s]() REQUIRES(s->mu) { return s->queue.empty() && !s->running; });
}

void drain_blocking_streams() {
  std::vector<cudaStream_t> all;
  {
    MutexLock g(g_streams_mu);
    for (auto s : g_streams)
      if (!(s->flags & cudaStreamNonBlocking)) all.push_back(s);
  }
  for (auto s : all) drain(s);
}

void drain_all_streams() {
  std::vector<cudaStream_t> all;
  {
    MutexLock g(g_streams_mu);
    all.assign(g_streams.begin(), g_streams.end());
  }
  for (auto s : all) drain(s);
}

void inject_fault(const std::string& function, std::uint64_t nth_call, int cuda_error) {
  auto& f = faults();
  MutexLock g(f.mu);
  f.planned[{function, nth_call}] = static_cast<cudaError_t>(cuda_error);
}

void reset_faults() {
  auto& f = faults();
  MutexLock g(f.mu);
  f.planned.clear();
  f.calls.clear();
}

std::uint64_t calls(const std::string& function) {
  auto& f = faults();
  MutexLock g(f.mu);
  auto it = f.calls.find(function);
  return it == f.calls.end() ? 0 : it->second;
}

void set_op_delay_us(std::uint32_t us) { g_op_delay_us.store(us); }

void set_stream_delay_us(void* stream, std::uint32_t us) {
  if (stream != nullptr) static_cast<cudaStream_t>(stream)->delay_us.store(us);
}

cudaError_t enqueue_launch(cudaStream_t stream, dim3 grid, dim3 block, std::function<void()> body) {
  if (const cudaError_t e = enter("cudaLaunchKernel"); e != cudaSuccess) return e;
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || grid.y > 65535 ||
      grid.z > 65535) {
    (void)take_async_fault();
    return fail(cudaErrorInvalidConfiguration);
  }
  return submit(stream, [grid, block, body = std::move(body)]() -> cudaError_t {
    tl_grid_dim = grid;
    tl_block_dim = block;
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
    return cudaSuccess;
  });
}

}  // namespace cudasim

using namespace cudasim;

// Events: a recorded generation and a completed generation. Interprocess events keep them in a
// shared memory file (memfd) that the handle names (pid + descriptor), so another process maps
// the same counters.
struct EventCounters {
  std::atomic<std::uint64_t> recorded{0};
  std::atomic<std::uint64_t> completed{0};
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

struct CUevent_st {
  EventCounters* c = nullptr;
  EventCounters local;
  int fd = -1;         // interprocess: the memfd holding *c
  bool mapped = false;  // *c is a shared mapping
  unsigned flags = 0;
};

namespace {

constexpr std::uint32_t kEventHandleMagic = 0x56455443;  // "CTEV"

struct EventHandleBytes {
  std::uint32_t magic;
  std::int32_t pid;
  std::int32_t fd;
};
static_assert(sizeof(EventHandleBytes) <= sizeof(cudaIpcEventHandle_t));

void wait_generation(const EventCounters* c, std::uint64_t gen) {
  while (c->completed.load(std::memory_order_acquire) < gen && sticky_error() == cudaSuccess)
    std::this_thread::sleep_for(std::chrono::microseconds(20));
}

}  // namespace

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t s = sticky_error();
  if (s != cudaSuccess) return s;  // sticky: never reset
  const cudaError_t e = tl_last_error;
  tl_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) {
  const cudaError_t s = sticky_error();
  return s != cudaSuccess ? s : tl_last_error;
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
  tl_device = device;
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
  *device = tl_device;
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
  s->worker = std::thread(worker_loop, s);
  {
    MutexLock g(g_streams_mu);
    g_streams.insert(s);
  }
  *stream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (const cudaError_t e = enter("cudaStreamDestroy"); e != cudaSuccess && e != sticky_error()) return e;
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  {
    MutexLock g(g_streams_mu);
    if (!g_streams.erase(s)) return fail(cudaErrorInvalidResourceHandle);
  }
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

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (const cudaError_t e = enter("cudaStreamSynchronize"); e != cudaSuccess) return e;
  drain(s);
  return fail(sticky_error());
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (const cudaError_t e = enter("cudaEventCreateWithFlags"); e != cudaSuccess) return e;
  const unsigned known = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (!event || (flags & ~known) != 0) return fail(cudaErrorInvalidValue);
  // CUDA: an interprocess event must also disable timing.
  if ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming)) return fail(cudaErrorInvalidValue);
  auto* ev = new CUevent_st;
  ev->flags = flags;
  ev->c = &ev->local;
  if (flags & cudaEventInterprocess) {
    const int fd = memfd_create("cudasim_event", MFD_CLOEXEC);
    void* p = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, sizeof(EventCounters)) == 0)
      p = mmap(nullptr, sizeof(EventCounters), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      if (fd >= 0) close(fd);
      delete ev;
      return fail(cudaErrorMemoryAllocation);
    }
    ev->c = new (p) EventCounters;
    ev->fd = fd;
    ev->mapped = true;
  }
  *event = ev;
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t ev) {
  if (const cudaError_t e = enter("cudaEventDestroy"); e != cudaSuccess && e != sticky_error()) return e;
  if (!ev) return fail(cudaErrorInvalidResourceHandle);
  if (ev->mapped) munmap(ev->c, sizeof(EventCounters));
  if (ev->fd >= 0) close(ev->fd);
  delete ev;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t s) {
  if (const cudaError_t e = enter("cudaEventRecord"); e != cudaSuccess) return e;
  if (!ev) return fail(cudaErrorInvalidResourceHandle);
  const std::uint64_t gen = ev->c->recorded.fetch_add(1, std::memory_order_acq_rel) + 1;
  EventCounters* c = ev->c;
  return submit(s, [c, gen]() -> cudaError_t {
    std::uint64_t cur = c->completed.load(std::memory_order_acquire);
    while (cur < gen && !c->completed.compare_exchange_weak(cur, gen, std::memory_order_acq_rel)) {
    }
    return cudaSuccess;
  });
}

cudaError_t cudaEventQuery(cudaEvent_t ev) {
  if (const cudaError_t e = enter("cudaEventQuery"); e != cudaSuccess) return e;
  if (!ev) return fail(cudaErrorInvalidResourceHandle);
  // Not an error: cudaErrorNotReady is not recorded as the last error.
  return ev->c->completed.load(std::memory_order_acquire) >= ev->c->recorded.load(std::memory_order_acquire)
             ? cudaSuccess
             : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
  if (const cudaError_t e = enter("cudaEventSynchronize"); e != cudaSuccess) return e;
  if (!ev) return fail(cudaErrorInvalidResourceHandle);
  const std::uint64_t gen = ev->c->recorded.load(std::memory_order_acquire);
  while (ev->c->completed.load(std::memory_order_acquire) < gen) {
    if (sticky_error() != cudaSuccess) return fail(sticky_error());  // the work will never finish
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return fail(sticky_error());
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned int flags) {
  if (const cudaError_t e = enter("cudaStreamWaitEvent"); e != cudaSuccess) return e;
  if (!ev || flags != 0) return fail(!ev ? cudaErrorInvalidResourceHandle : cudaErrorInvalidValue);
  const std::uint64_t gen = ev->c->recorded.load(std::memory_order_acquire);  // the record before this call
  EventCounters* c = ev->c;
  return submit(s, [c, gen]() -> cudaError_t {
    wait_generation(c, gen);
    return cudaSuccess;
  });
}

cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t ev) {
  if (const cudaError_t e = enter("cudaIpcGetEventHandle"); e != cudaSuccess) return e;
  if (!handle || !ev) return fail(cudaErrorInvalidValue);
  if (!(ev->flags & cudaEventInterprocess) || ev->fd < 0) return fail(cudaErrorInvalidResourceHandle);
  std::memset(handle, 0, sizeof *handle);
  const EventHandleBytes b{kEventHandleMagic, static_cast<std::int32_t>(getpid()), ev->fd};
  std::memcpy(handle, &b, sizeof b);
  return cudaSuccess;
}

cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t handle) {
  if (const cudaError_t e = enter("cudaIpcOpenEventHandle"); e != cudaSuccess) return e;
  if (!event) return fail(cudaErrorInvalidValue);
  EventHandleBytes b{};
  std::memcpy(&b, &handle, sizeof b);
  if (b.magic != kEventHandleMagic) return fail(cudaErrorInvalidResourceHandle);
  const std::string path = "/proc/" + std::to_string(b.pid) + "/fd/" + std::to_string(b.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return fail(cudaErrorInvalidResourceHandle);  // the exporter is gone
  void* p = mmap(nullptr, sizeof(EventCounters), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return fail(cudaErrorMapBufferObjectFailed);
  }
  auto* ev = new CUevent_st;
  ev->flags = cudaEventDisableTiming | cudaEventInterprocess;
  ev->c = static_cast<EventCounters*>(p);
  ev->fd = fd;
  ev->mapped = true;
  *event = ev;
  return cudaSuccess;
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

}  // extern "C"
