#include "kvtd/kernels/host_copy.h"

#include <cstring>

namespace kvtd::kernels {

void copy_blocks_host(const CopyPlan& plan, const CopyTarget& t) noexcept {
  const std::uint64_t bb = t.block_bytes, ss = t.src_stride, ds = t.dst_stride;
  if (bb == 0) return;
  const bool packed = ss == bb && ds == bb;
  for (const CopyRun& r : plan.runs) {
    const std::byte* s = t.src + static_cast<std::uint64_t>(r.src) * ss;
    std::byte* d = t.dst + static_cast<std::uint64_t>(r.dst) * ds;
    if (packed) {
      std::memcpy(d, s, static_cast<std::uint64_t>(r.count) * bb);  // one copy per run
      continue;
    }
    for (std::int32_t i = 0; i < r.count; ++i, s += ss, d += ds) std::memcpy(d, s, bb);
  }
  const std::size_t n = plan.single_src.size();
  for (std::size_t i = 0; i < n; ++i) {
    std::memcpy(t.dst + static_cast<std::uint64_t>(plan.single_dst[i]) * ds,
                t.src + static_cast<std::uint64_t>(plan.single_src[i]) * ss, bb);
  }
}

void copy_all_host(const CopyPlan& plan, std::span<const CopyTarget> targets) noexcept {
  for (const CopyTarget& t : targets) copy_blocks_host(plan, t);
}

void copy_layerwise_host(const CopyPlan& plan, std::span<const CopyTarget> targets,
                         std::size_t targets_per_layer,
                         const std::function<void(std::uint32_t layer)>& on_layer_done) {
  if (targets_per_layer == 0) return;
  std::uint32_t layer = 0;
  for (std::size_t i = 0; i < targets.size(); i += targets_per_layer, ++layer) {
    const std::size_t end = i + targets_per_layer < targets.size() ? i + targets_per_layer : targets.size();
    for (std::size_t j = i; j < end; ++j) copy_blocks_host(plan, targets[j]);
    if (on_layer_done) on_layer_done(layer);
  }
}

}  // namespace kvtd::kernels
