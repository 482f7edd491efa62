// --verify-swaps: a swapped-out block's checksums, taken where the device blocks are, stay with its
// host block; after the block comes back in, the device computes them again and a difference
// fails the swap-in (integrity), so the engine never runs on a byte that changed in host memory.
#include <cinttypes>
#include <cstdio>
#include <fmt/format.h>

#include "swap_lanes.h"

namespace kvtd::daemon {

using proto::TaskStatus;

SwapLanes::VerifiedBlocks SwapLanes::blocks_to_verify(const SwapPart& p, bool swap_in, std::size_t targets) const {
  VerifiedBlocks v;
  const HostPool* pool = cache_.groups[p.group].pool;
  if (cache_.verify_swaps == config::VerifySwaps::kOff || pool == nullptr) return v;
  for (std::size_t i = 0; i < p.host_ids.size() && i < p.device_ids.size(); ++i) {
    if (cache_.verify_swaps == config::VerifySwaps::kSampled && p.host_ids[i] % config::kVerifySampleEvery != 0) continue;
    // None kept: the block was written before this process (a restarted daemon) or unsampled.
    if (swap_in && pool->checksums(p.host_ids[i]).size() != targets) continue;
    v.device.push_back(p.device_ids[i]);
    v.host.push_back(p.host_ids[i]);
  }
  return v;
}

void SwapLanes::keep_checksums(std::uint32_t group, const VerifiedBlocks& v, std::span<const std::uint64_t> sums,
                               std::size_t targets) {
  HostPool* pool = cache_.groups[group].pool;
  const std::size_t n = v.device.size();
  std::vector<std::uint64_t> per_block(targets);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t t = 0; t < targets; ++t) per_block[t] = sums[t * n + i];
    pool->set_checksums(v.host[i], per_block);
  }
}

std::optional<SwapLanes::Failure> SwapLanes::check_checksums(std::uint32_t group, const VerifiedBlocks& v,
                                                            std::span<const std::uint64_t> sums,
                                                            std::size_t targets, std::size_t first) const {
  const GroupCache& g = cache_.groups[group];
  const std::size_t n = v.device.size();
  if (n == 0) return std::nullopt;
  const std::size_t per_layer = g.num_layers == 0 ? 1 : std::max<std::size_t>(1, targets / g.num_layers);
  const std::string layer_of = cache_.groups.size() > 1 ? fmt::format("cache group {}, its layer ", group) : "layer ";
  for (std::size_t i = 0; i < n; ++i) {
    const auto kept = g.pool->checksums(v.host[i]);  // one per target: blocks_to_verify chose it so
    for (std::size_t t = first; t < first + sums.size() / n; ++t) {
      const std::uint64_t now = sums[(t - first) * n + i];
      if (now == kept[t]) continue;
      char text[160];
      std::snprintf(text, sizeof text, "checksum %016" PRIx64 " after the copy, %016" PRIx64 " at swap-out", now, kept[t]);
      return std::pair{TaskStatus::kIntegrity,
                       fmt::format("rank {}, {}{} (tensor {} of the layer), host block {} -> device block {}: {}: "
                                   "the host copy changed after it was written; do not use these blocks",
                                   ep_.rank(), layer_of, t / per_layer, t % per_layer, g.host_base + v.host[i],
                                   g.device_base + v.device[i], text)};
    }
  }
  return std::nullopt;
}

}  // namespace kvtd::daemon
