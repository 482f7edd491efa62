// The stand-in's runtime core: devices, errors (per-thread last error, process-wide sticky
// error), fault injection, streams with worker threads and launches. The runtime API over it:
// api.cpp (devices, streams, errors) and events.cpp (events, also across processes).
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
#include <utility>
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
// Set by enter() for a call planned to hang (KVTD_CUDASIM_FAULTS=fn:n:hang), taken by the
// enqueue: that call's work never finishes, as on a device that stopped.
thread_local bool tl_hang = false;

struct Faults {
  Mutex mu;
  std::map<std::string, std::uint64_t> calls GUARDED_BY(mu);
  std::map<std::pair<std::string, std::uint64_t>, cudaError_t> planned GUARDED_BY(mu);
  std::set<std::pair<std::string, std::uint64_t>> hangs GUARDED_BY(mu);
  // KVTD_CUDASIM_CALL_COUNTS=FILE: every runtime function's call count, one "name count" line
  // each, written at exit (how many CUDA calls a daemon makes per task, which the stand-in can
  // count where it cannot time them).
  ~Faults() {
    const char* path = std::getenv("KVTD_CUDASIM_CALL_COUNTS");
    if (path == nullptr) return;
    if (std::FILE* out = std::fopen(path, "w")) {
      MutexLock g(mu);
      for (const auto& [name, n] : calls) std::fprintf(out, "%s %llu\n", name.c_str(), static_cast<unsigned long long>(n));
      std::fclose(out);
    }
  }
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
          const std::pair<std::string, std::uint64_t> call{item.substr(0, c1),
                                                           std::strtoull(item.c_str() + c1 + 1, nullptr, 10)};
          if (item.substr(c2 + 1) == "hang") hangs.insert(call);
          else planned[call] = static_cast<cudaError_t>(std::atoi(item.c_str() + c2 + 1));
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
      if (const cudaError_t e = run_device_work(op); e != cudaSuccess) set_sticky(e);
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

cudaError_t take_last_error() {
  const cudaError_t e = tl_last_error;
  tl_last_error = cudaSuccess;
  return e;
}

cudaError_t peek_last_error() { return tl_last_error; }
void set_current_device(int device) { tl_device = device; }

void start_stream(cudaStream_t s) {
  s->worker = std::thread(worker_loop, s);
  MutexLock g(g_streams_mu);
  g_streams.insert(s);
}

bool forget_stream(cudaStream_t s) {
  MutexLock g(g_streams_mu);
  return g_streams.erase(s) != 0;
}

// The errors whose documentation in driver_types.h says the process "is left in an inconsistent
// state" or "must be terminated and relaunched": the stand-in's whole model of stickiness. kvtd
// itself keeps no list (it asks whether the error survives cudaGetLastError), so this one is the
// only place a code is named.
bool is_sticky(int e) {
  switch (e) {
    case cudaErrorECCUncorrectable:       // 214
    case cudaErrorContained:              // 226
    case cudaErrorIllegalAddress:         // 700
    case cudaErrorLaunchTimeout:          // 702
    case cudaErrorHardwareStackError:     // 714
    case cudaErrorIllegalInstruction:     // 715
    case cudaErrorMisalignedAddress:      // 716
    case cudaErrorInvalidAddressSpace:    // 717
    case cudaErrorInvalidPc:              // 718
    case cudaErrorLaunchFailure:          // 719
    case cudaErrorAssert:                 // 710
    case cudaErrorTensorMemoryLeak:       // 721
    case cudaErrorMpsClientTerminated:    // 810
    case cudaErrorExternalDevice:         // 911
      return true;
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
  make_primary_context_current();
  tl_async_fault = cudaSuccess;
  tl_hang = false;
  auto& f = faults();
  cudaError_t planned = cudaSuccess;
  {
    MutexLock g(f.mu);
    const std::uint64_t n = ++f.calls[function];
    if (auto it = f.planned.find({function, n}); it != f.planned.end()) planned = it->second;
    tl_hang = f.hangs.count({function, n}) != 0;
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
  if (const cudaError_t fault = take_async_fault(); std::exchange(tl_hang, false)) {
    op = [] {  // runs until the process ends: nothing after it on the stream ever runs
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      return cudaSuccess;
    };
  } else if (fault != cudaSuccess) {
    op = [fault] { return fault; };  // the work never happens; the context breaks when it "runs"
  }
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    drain_blocking_streams();
    if (sticky_error() == cudaSuccess)
      if (const cudaError_t e = run_device_work(op); e != cudaSuccess) set_sticky(e);
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

namespace {

// The streams that synchronise with the legacy stream (created without cudaStreamNonBlocking).
std::vector<cudaStream_t> blocking_streams() {
  std::vector<cudaStream_t> all;
  MutexLock g(g_streams_mu);
  for (auto s : g_streams)
    if (!(s->flags & cudaStreamNonBlocking)) all.push_back(s);
  return all;
}

}  // namespace

bool stream_idle(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) {
    for (auto b : blocking_streams())
      if (!stream_idle(b)) return false;
    return true;
  }
  MutexLock lk(s->mu);
  return s->queue.empty() && !s->running;
}

void drain_blocking_streams() {
  for (auto s : blocking_streams()) drain(s);
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

}  // namespace cudasim
