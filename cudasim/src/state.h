// state.h (cudasim-internal) - what the stand-in runtime keeps: errors and faults, streams and
// their worker threads, events, and the map of device and pinned memory ranges.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "kvtd/base/mutex.h"

namespace cudasim {

using kvtd::CondVar;
using kvtd::Mutex;
using kvtd::MutexLock;

// --- errors ------------------------------------------------------------------------------
// The calling thread's last error: taken (and reset) or peeked.
cudaError_t take_last_error();
cudaError_t peek_last_error();
// The calling thread's current device (cudaSetDevice; current_device() below reads it).
void set_current_device(int device);
// Records `e` as the calling thread's last error (unless success) and returns it.
cudaError_t fail(cudaError_t e);
// The process's sticky error (cudaSuccess while the context is healthy).
cudaError_t sticky_error();
void set_sticky(cudaError_t e);
// Starts an API call: the sticky error if the context is broken, else the injected fault of
// this call of `function` (non-sticky faults only; see take_async_fault), else success.
cudaError_t enter(const char* function);
// For calls that enqueue work: a sticky fault injected into this call, to raise when it runs.
cudaError_t take_async_fault();
int current_device();
int device_count();
// The driver API's current context of the calling thread (contexts.cpp). As with cudart, the
// first runtime call on a thread makes its device's primary context current (enter() does);
// a thread that made none has no context, and driver calls on memory then fail
// CUDA_ERROR_INVALID_CONTEXT, as FastDeploy's transfer threads found on an H100.
void make_primary_context_current();
bool has_current_context();

// --- streams -------------------------------------------------------------------------------
// One operation on a stream: returns an error to poison the context (async faults).
using Op = std::function<cudaError_t()>;

}  // namespace cudasim

// A stream: a FIFO of operations run in order by one worker thread. Nothing orders two streams
// except events (cudaStreamWaitEvent); the legacy default stream (null) runs its operations in
// the calling thread after waiting for every blocking stream.
struct CUstream_st {
  unsigned flags = 0;
  std::atomic<std::uint32_t> delay_us{0};  // cudasim::set_stream_delay_us
  kvtd::Mutex mu;
  kvtd::CondVar cv;
  std::deque<cudasim::Op> queue GUARDED_BY(mu);
  bool running GUARDED_BY(mu) = false;  // the worker is inside an operation
  bool stop GUARDED_BY(mu) = false;
  std::thread worker;
};

namespace cudasim {

// Enqueues `op` on `s` (null: runs it now, after the blocking streams drained). The operation
// is skipped when the context is already broken; a failing operation breaks it.
cudaError_t submit(cudaStream_t s, Op op);
// Waits until everything enqueued on `s` before this call ran.
void drain(cudaStream_t s);
// Whether nothing enqueued on `s` is waiting or running (the legacy stream: every blocking one).
bool stream_idle(cudaStream_t s);
void drain_blocking_streams();
void drain_all_streams();
// A new stream's worker thread starts and the stream is counted as existing; forget_stream
// un-counts it (false: it did not exist).
void start_stream(cudaStream_t s);
bool forget_stream(cudaStream_t s);

// --- memory --------------------------------------------------------------------------------
enum class Space { kUnknown, kDevice, kPinnedHost };
// Runs one device operation (stream worker or legacy stream). Device memory is sealed from host
// code except for the ranges the running operations opened (device_access.cpp says why).
cudaError_t run_device_work(const Op& op);
// Called by a device operation before it touches [p, p + n): opens the device range holding it
// until the operation ends. Not device memory, or not inside an operation: nothing.
void open_for_device_work(const void* p, std::size_t n);
// A new device range starts sealed; a range about to be unmapped is forgotten.
void seal_device_range(void* base, std::size_t bytes);
void forget_device_range(void* base);
// The address device code reaches pinned host memory `host` by (cudaHostGetDevicePointer).
void* mapped_host_address(void* host);
// What the byte range [p, p + n) is: device memory (cudaMalloc, an opened IPC handle), pinned
// host memory (cudaHostAlloc, cudaHostRegister), or unknown (pageable host memory).
Space space_of(const void* p, std::size_t n);
// What holds [p, p + n) and its bounds [*lo, *hi) (kUnknown: no device or pinned range does).
Space range_of(const void* p, std::size_t n, std::uintptr_t* lo, std::uintptr_t* hi);

}  // namespace cudasim

// The driver API's cuMemGetAddressRange (memory.cpp), handed out by the runtime's driver entry
// point (api.cpp) the way libcuda's is.
extern "C" CUresult cudasim_cuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr dptr);
