// kvtd/cudasim/control.h - the test-only CUDA runtime stand-in (libkvtd_cudasim): what a test
// can do to it beyond the CUDA API it implements (see cudasim/README.md for what it models).
//
// Fault injection: the n-th call (1-based, counted per function name since the process
// started or since reset_faults) of `function` fails with `error`. Context-poisoning errors
// (cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorMisalignedAddress, ...) injected
// into an asynchronous call (a copy or kernel enqueued on a stream) are raised when that work
// runs, as the hardware would: the work is skipped, the error becomes sticky and every later
// call of the process returns it. Any other error is returned by the call itself, which then
// does nothing. Also from the environment, read once at the first CUDA call:
//   KVTD_CUDASIM_FAULTS="cudaMemcpyAsync:3:700,cudaLaunchKernel:1:719"
//   KVTD_CUDASIM_OP_DELAY_US=200     every stream operation sleeps first (ordering, progress)
//   KVTD_CUDASIM_DEVICES=2           visible devices (default 1; 0 = no device; read per call)
//   KVTD_CUDASIM_NO_HOST_POINTERS=1  cudaDevAttrCanUseHostPointerForRegisteredMem is 0
//   KVTD_CUDASIM_BATCH_MAX=16384     cudaMemcpyBatchAsync refuses more copies in one call
//   KVTD_CUDASIM_HOST_REGISTER_MAX=N cudaHostRegister refuses N bytes or more (default 512 GiB)
//   KVTD_CUDASIM_PIN_MBPS=R          cudaHostRegister takes bytes / R MB/s (read per call)
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdint>
#include <string>

namespace cudasim {

void inject_fault(const std::string& function, std::uint64_t nth_call, int cuda_error);
void reset_faults();  // forgets injected faults and call counts (not a sticky error)
// How many times `function` was called so far.
std::uint64_t calls(const std::string& function);
// Every stream operation sleeps this long before it runs (0: none).
void set_op_delay_us(std::uint32_t us);
// Only the operations of `stream` (a cudaStream_t) sleep this long first: a slow stream.
void set_stream_delay_us(void* stream, std::uint32_t us);
// Whether an error is sticky in CUDA (poisons the context for the rest of the process).
bool is_sticky(int cuda_error);

}  // namespace cudasim
