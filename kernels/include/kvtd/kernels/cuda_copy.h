// kvtd/kernels/cuda_copy.h - host-callable launchers of the CUDA copy kernels.
//
// CUDA types stay out of this header: streams are passed as void* (cudaStream_t), results as
// the int value of cudaError_t (0 = success), so files that include it need no CUDA headers.
// Only present in builds with the CUDA toolkit (KVTD_HAVE_CUDA).
//
// Thread-safety: launches are asynchronous on the given stream; callers synchronise.
#pragma once

#include <cstdint>

#include "kvtd/kernels/host_copy.h"

namespace kvtd::kernels {

// Copies `count` scattered blocks of one tensor: block src_ids[i] of target.src to block
// dst_ids[i] of target.dst, one warp per block (16-byte vector accesses when the addresses and
// block size allow, else 8-byte, else bytes; streaming loads and stores). `d_src_ids` and
// `d_dst_ids` are device-accessible arrays. Pointers may be device or mapped pinned host memory.
int launch_scattered_copy(const CopyTarget& target, const std::int32_t* d_src_ids, const std::int32_t* d_dst_ids,
                          std::int64_t count, void* stream);

const char* cuda_error_text(int error);

}  // namespace kvtd::kernels
