// kvtd/kernels/cuda_copy.h - host-callable launchers of the CUDA copy kernels.
//
// CUDA types stay out of this header: streams are passed as void* (cudaStream_t), results as
// the int value of cudaError_t (0 = success), so files that include it need no CUDA headers.
// Only linked in builds with the CUDA toolkit (KVTD_HAVE_CUDA).
//
// Every kernel copies with one warp per block: 16-byte vector accesses when both addresses and
// the size are 16-byte aligned, else 8-byte, else bytes; streaming (non-temporal) loads and
// stores so a swap does not evict the model's working set from L2. Pointers may be device
// memory or mapped pinned host memory.
//
// Thread-safety: launches are asynchronous on the given stream; callers synchronise.
#pragma once

#include <cstdint>

#include "kvtd/kernels/host_copy.h"
#include "kvtd/kernels/layout.h"

namespace kvtd::kernels {

// One tensor: block src_ids[i] of target.src -> block dst_ids[i] of target.dst, i < count.
// `d_src_ids` / `d_dst_ids` are device-accessible arrays.
int launch_scattered_copy(const CopyTarget& target, const std::int32_t* d_src_ids, const std::int32_t* d_dst_ids,
                          std::int64_t count, void* stream);

// Every tensor in one launch: `d_targets` is a device-accessible table of `num_targets` targets
// (the layers' base pointers), the ids are shared by all of them.
int launch_scattered_copy_all(const CopyTarget* d_targets, std::uint32_t num_targets, const std::int32_t* d_src_ids,
                              const std::int32_t* d_dst_ids, std::int64_t count, void* stream);

// Layout transform, same layout as gather_to_staging_host / scatter_from_staging_host.
// `d_tensors` is a device-accessible table; `d_offsets[t]` is the byte offset of tensor t inside
// one staged object (a prefix sum of block_bytes); `object_bytes` the size of one object.
int launch_gather_to_staging(const LayerTensor* d_tensors, const std::uint64_t* d_offsets, std::uint32_t num_tensors,
                             const std::int32_t* d_ids, std::int64_t count, std::byte* staging,
                             std::uint64_t object_bytes, void* stream);
int launch_scatter_from_staging(const LayerTensor* d_tensors, const std::uint64_t* d_offsets,
                                std::uint32_t num_tensors, const std::int32_t* d_ids, std::int64_t count,
                                const std::byte* staging, std::uint64_t object_bytes, void* stream);

}  // namespace kvtd::kernels
