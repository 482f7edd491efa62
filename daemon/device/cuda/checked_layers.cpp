// The CUDA backend's layer-by-layer copies that check as they go (--verify-swaps on a
// layer-by-layer swap-in): each layer's checksums ride its own copy on the stream, ahead of the
// layer's event, so the caller holds each layer's checksums the moment the layer is done and can
// check it before reporting it, with no second pass over the blocks after the last layer.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <vector>

namespace kvtd::daemon::cuda {

Status<DeviceErrc> CudaBackend::copy_layerwise_checked(Direction dir, const kernels::CopyPlan& plan,
                                                       std::span<const kernels::CopyTarget> targets,
                                                       std::size_t per_layer, std::span<const std::int32_t> ids,
                                                       const LayerCallback& on_layer_enqueued,
                                                       const CheckedLayer& on_layer_checked) {
  if (per_layer == 0) return {};
  Lane& lane = lane_of(dir);
  MutexLock g(lane.mu);
  BusyMark busy(lane);
  KVTD_CUDA_TRY(cudaSetDevice(device_));
  auto st = copy_layerwise_checked_locked(lane, dir, plan, targets, per_layer, ids, on_layer_enqueued, on_layer_checked);
  if (!st.ok()) lane.drain();  // as in copy(): nothing may still write once we report failure
  return st;
}

Status<DeviceErrc> CudaBackend::copy_layerwise_checked_locked(Lane& lane, Direction dir, const kernels::CopyPlan& plan,
                                                              std::span<const kernels::CopyTarget> targets,
                                                              std::size_t per_layer, std::span<const std::int32_t> ids,
                                                              const LayerCallback& on_layer_enqueued,
                                                              const CheckedLayer& on_layer_checked) {
  const std::size_t layers = (targets.size() + per_layer - 1) / per_layer;
  const std::size_t n = ids.size();
  KVTD_TRY(ensure_events(lane, layers));
  // Kernel mode: each layer's launch of the all-layers kernel over the plan's pairs sums what it
  // moves into its own stretch of the words after the ids; elsewhere the checksum kernel follows
  // each layer's copy, reading the layer's blocks once more.
  std::optional<SummingCopy> fused;
  if (mode_ == ScatterMode::kKernelAllLayers) fused = summing_pairs(dir, plan, ids);
  std::uint64_t* d_sums = nullptr;
  StagedChecksums staged;
  if (fused) {
    KVTD_TRY(stage_plan(lane, fused->plan, targets, targets.size() * fused->pairs));
    const std::size_t at = sums_offset(fused->pairs);
    d_sums = reinterpret_cast<std::uint64_t*>(static_cast<std::byte*>(lane.ids.dev) + at);
    fused->results = reinterpret_cast<const std::uint64_t*>(static_cast<std::byte*>(lane.ids.host) + at);
  } else {
    KVTD_TRY(stage_plan(lane, plan, targets));
    KVTD_ASSIGN_OR_RETURN(staged, stage_checksums(lane, dir, targets, ids));
  }
  for (std::size_t l = 0; l < layers; ++l) {
    const std::size_t first = l * per_layer;
    const std::size_t count = std::min(per_layer, targets.size() - first);
    const auto layer_targets = targets.subspan(first, count);
    if (fused) {
      const std::size_t at = first * fused->pairs;
      KVTD_TRY(enqueue(lane, fused->plan, layer_targets, /*all_layers=*/true, first, d_sums + at));
      KVTD_CUDA_TRY(cudaMemcpyAsync(const_cast<std::uint64_t*>(fused->results) + at, d_sums + at,
                                    count * fused->pairs * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, lane.stream));
    } else {
      KVTD_TRY(enqueue(lane, plan, layer_targets, /*all_layers=*/false, first));
      KVTD_TRY(enqueue_staged_checksums(lane, staged, first, count));
    }
    KVTD_CUDA_TRY(cudaEventRecord(lane.events[l], lane.stream));
    if (on_layer_enqueued) on_layer_enqueued(static_cast<std::uint32_t>(l));
  }
  std::vector<std::uint64_t> sums;
  for (std::size_t l = 0; l < layers; ++l) {
    KVTD_CUDA_TRY(cudaEventSynchronize(lane.events[l]));
    const std::size_t first = l * per_layer;
    const std::size_t count = std::min(per_layer, targets.size() - first);
    sums.assign(count * n, 0);
    for (std::size_t t = 0; t < count; ++t)
      for (std::size_t k = 0; k < n; ++k)
        sums[t * n + k] = fused ? fused->results[(first + t) * fused->pairs + fused->pair_of_id[k]]
                                : staged.host_results[(first + t) * n + k];
    if (on_layer_checked) on_layer_checked(static_cast<std::uint32_t>(l), sums);
  }
  return {};
}

}  // namespace kvtd::daemon::cuda
