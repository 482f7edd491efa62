// The CUDA backend's enqueue modes: a plan's runs by cudaMemcpyAsync, its scattered blocks by
// cudaMemcpyBatchAsync (copy engines), one all-layers kernel launch, one per layer, or memcpys.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cstring>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/proto/pci.h"

namespace kvtd::daemon::cuda {

Status<DeviceErrc> CudaBackend::stage_plan(Lane& lane, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
                                           std::size_t sum_words) {
  const std::size_t n = plan.single_src.size();
  if (n == 0 || mode_ == ScatterMode::kBatch || mode_ == ScatterMode::kMemcpy) return {};
  const std::size_t ids_bytes = 2 * n * sizeof(std::int32_t);
  const std::size_t bytes = sum_words == 0 ? ids_bytes : sums_offset(n) + sum_words * sizeof(std::uint64_t);
  KVTD_TRY(lane.ids.reserve(bytes));
  std::memcpy(lane.ids.host, plan.single_src.data(), n * sizeof(std::int32_t));
  std::memcpy(static_cast<std::int32_t*>(lane.ids.host) + n, plan.single_dst.data(), n * sizeof(std::int32_t));
  // The sums start at zero (the kernel adds into them): zeroed here, they ride the ids' upload
  // instead of costing a memset on the stream.
  std::memset(static_cast<std::byte*>(lane.ids.host) + ids_bytes, 0, bytes - ids_bytes);
  KVTD_TRY(lane.ids.upload(bytes, lane.stream));
  return upload_table(lane, lane.table, targets.data(), targets.size_bytes());
}

Status<DeviceErrc> CudaBackend::upload_table(Lane& lane, CachedTable& t, const void* table, std::size_t bytes) {
  const auto* p = static_cast<const std::byte*>(table);
  if (t.mirror.dev != nullptr && t.contents.size() == bytes && std::memcmp(t.contents.data(), p, bytes) == 0)
    return {};
  t.contents.clear();  // unknown until the upload below is enqueued
  KVTD_TRY(t.mirror.reserve(bytes));
  std::memcpy(t.mirror.host, p, bytes);
  KVTD_TRY(t.mirror.upload(bytes, lane.stream));
  t.contents.assign(p, p + bytes);
  return {};
}

Status<DeviceErrc> CudaBackend::enqueue(Lane& lane, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
                           bool all_layers, std::size_t first, std::uint64_t* d_sums) {
  // The all-layers kernel covers every target in one launch (kernel mode).
  const bool one_launch = mode_ == ScatterMode::kKernelAllLayers && (all_layers || targets.size() > 1);
  if (d_sums != nullptr && (!one_launch || !plan.runs.empty()))  // runs would go uncounted
    return make_error(DeviceErrc::kCopyFailed, "a summing copy needs the all-layers kernel and a plan of singles");
  // Batch mode: runs and scattered blocks of every target in one cudaMemcpyBatchAsync.
  if (mode_ == ScatterMode::kBatch) return enqueue_batch(lane, plan, targets);
  for (const auto& t : targets)
    for (const auto& r : plan.runs) {
      std::byte* d = t.dst + static_cast<std::uint64_t>(r.dst) * t.dst_stride;
      const std::byte* s = t.src + static_cast<std::uint64_t>(r.src) * t.src_stride;
      if (t.src_stride == t.block_bytes && t.dst_stride == t.block_bytes) {
        KVTD_CUDA_TRY(cudaMemcpyAsync(d, s, static_cast<std::uint64_t>(r.count) * t.block_bytes, cudaMemcpyDefault,
                                      lane.stream));
      } else {  // a page-first side: one 2-D copy, a row per block
        KVTD_CUDA_TRY(cudaMemcpy2DAsync(d, t.dst_stride, s, t.src_stride, t.block_bytes,
                                        static_cast<std::size_t>(r.count), cudaMemcpyDefault, lane.stream));
      }
    }
  const std::size_t n = plan.single_src.size();
  if (n == 0) return {};
  const auto* d_src = static_cast<const std::int32_t*>(lane.ids.dev);
  const auto* d_dst = d_src + n;
  std::uint64_t max_block = 0;
  for (const auto& t : targets) max_block = std::max<std::uint64_t>(max_block, t.block_bytes);
  const std::uint32_t parts = pieces(max_block, n * (one_launch ? targets.size() : 1));
  switch (mode_) {
    case ScatterMode::kKernelAllLayers:
      if (one_launch) {
        const auto* table = static_cast<const kernels::CopyTarget*>(lane.table.mirror.dev) + first;
        const int e = kernels::launch_scattered_copy_all(table, static_cast<std::uint32_t>(targets.size()), d_src,
                                                         d_dst, static_cast<std::int64_t>(n), lane.stream, parts, d_sums);
        if (e != 0) return make_error(errc_of(static_cast<cudaError_t>(e)), cuda_text("copy kernel", static_cast<cudaError_t>(e)));
        return {};
      }
      [[fallthrough]];
    case ScatterMode::kKernelPerLayer:
      for (const auto& t : targets) {
        const int e = kernels::launch_scattered_copy(t, d_src, d_dst, static_cast<std::int64_t>(n), lane.stream, parts);
        if (e != 0) return make_error(errc_of(static_cast<cudaError_t>(e)), cuda_text("copy kernel", static_cast<cudaError_t>(e)));
      }
      return {};
    case ScatterMode::kMemcpy:
      for (const auto& t : targets)
        for (std::size_t i = 0; i < n; ++i)
          KVTD_CUDA_TRY(cudaMemcpyAsync(t.dst + static_cast<std::uint64_t>(plan.single_dst[i]) * t.dst_stride,
                                        t.src + static_cast<std::uint64_t>(plan.single_src[i]) * t.src_stride,
                                        t.block_bytes, cudaMemcpyDefault, lane.stream));
      return {};
    case ScatterMode::kBatch: return {};  // enqueued above
  }
  return {};
}

Status<DeviceErrc> CudaBackend::enqueue_batch(Lane& lane, const kernels::CopyPlan& plan,
                                 std::span<const kernels::CopyTarget> targets) {
#if CUDART_VERSION >= 13000
  const std::size_t n = plan.single_src.size();
  lane.batch_dst.clear();
  lane.batch_src.clear();
  lane.batch_size.clear();
  auto add = [&](std::byte* d, const std::byte* s, std::uint64_t bytes) REQUIRES(lane.mu) {
    lane.batch_dst.push_back(d);
    lane.batch_src.push_back(const_cast<std::byte*>(s));
    lane.batch_size.push_back(bytes);
  };
  for (const auto& t : targets) {
    for (const auto& r : plan.runs) {
      std::byte* d = t.dst + static_cast<std::uint64_t>(r.dst) * t.dst_stride;
      const std::byte* s = t.src + static_cast<std::uint64_t>(r.src) * t.src_stride;
      if (t.src_stride == t.block_bytes && t.dst_stride == t.block_bytes) {
        add(d, s, static_cast<std::uint64_t>(r.count) * t.block_bytes);  // a packed run: one copy
      } else {
        for (std::int64_t b = 0; b < r.count; ++b)
          add(d + static_cast<std::uint64_t>(b) * t.dst_stride, s + static_cast<std::uint64_t>(b) * t.src_stride,
              t.block_bytes);
      }
    }
    for (std::size_t i = 0; i < n; ++i)
      add(t.dst + static_cast<std::uint64_t>(plan.single_dst[i]) * t.dst_stride,
          t.src + static_cast<std::uint64_t>(plan.single_src[i]) * t.src_stride, t.block_bytes);
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  std::size_t attr_index = 0;
  // In calls of at most copy_batch_max_ copies: a task of 64 layers x 2 kinds x 500 blocks is
  // 64,000 descriptors, and drivers have crashed or hung near 52K in one call (vllm#49276). The
  // calls follow each other on one stream, so the task's copies still end before its sync.
  for (std::size_t first = 0; first < lane.batch_dst.size(); first += copy_batch_max_) {
    const std::size_t count = std::min(copy_batch_max_, lane.batch_dst.size() - first);
    KVTD_CUDA_TRY(cudaMemcpyBatchAsync(lane.batch_dst.data() + first, lane.batch_src.data() + first,
                                       lane.batch_size.data() + first, count, &attr, &attr_index, 1, lane.stream));
  }
  return {};
#else
  (void)lane;
  (void)plan;
  (void)targets;
  return make_error(DeviceErrc::kCopyFailed, "cudaMemcpyBatchAsync needs CUDA 13");
#endif
}

}  // namespace kvtd::daemon::cuda
