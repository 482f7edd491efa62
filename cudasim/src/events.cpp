// The stand-in's events: recorded and completed generations, interprocess through a memfd the
// handle names; cudaStreamWaitEvent orders one stream behind another's record.
#include <thread>
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

// Waits until generation `gen` of the event completed, or the context broke. An event opened
// from another process whose exporter died with its record still queued never completes, and
// neither does this wait: on an H100 (driver 580) a stream waiting on such an event had not
// moved after 120 s (../shared/gpu/results/2026-11-26-h100/evdeath-120s.log). The stand-in once
// failed the wait after a second, kinder than CUDA; kvtd must never enqueue such a wait.
cudaError_t wait_generation(const EventCounters* c, std::uint64_t gen) {
  while (c->completed.load(std::memory_order_acquire) < gen && sticky_error() == cudaSuccess)
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  return cudaSuccess;
}

}  // namespace


extern "C" {

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
  // Returns early on a sticky error (the work will never finish); never for a dead exporter's.
  (void)wait_generation(ev->c, gen);
  return fail(sticky_error());
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned int flags) {
  if (const cudaError_t e = enter("cudaStreamWaitEvent"); e != cudaSuccess) return e;
  // cudaEventWaitExternal is accepted (it matters only under graph capture), nothing else.
  if (!ev || (flags & ~static_cast<unsigned>(cudaEventWaitExternal)) != 0)
    return fail(!ev ? cudaErrorInvalidResourceHandle : cudaErrorInvalidValue);
  const std::uint64_t gen = ev->c->recorded.load(std::memory_order_acquire);  // the record before this call
  EventCounters* c = ev->c;
  return submit(s, [c, gen]() -> cudaError_t { return wait_generation(c, gen); });
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

}  // extern "C"
