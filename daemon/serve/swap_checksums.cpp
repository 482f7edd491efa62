// --verify-swaps: a swapped-out block's checksums, taken where the device blocks are, stay with its
// host block; after the block comes back in, the device computes them again and a difference
// fails the swap-in (integrity), so the engine never runs on a byte that changed in host memory.
#include <cinttypes>
#include <cstdio>

#include "swap_lanes.h"

namespace kvtd::daemon {

using proto::TaskStatus;

SwapLanes::VerifiedBlocks SwapLanes::blocks_to_verify(const Work& w, bool swap_in,
                                                                    std::size_t targets) const {
  VerifiedBlocks v;
  if (cache_.verify_swaps == config::VerifySwaps::kOff || cache_.pool == nullptr) return v;
  for (std::size_t i = 0; i < w.host_ids.size() && i < w.device_ids.size(); ++i) {
    if (cache_.verify_swaps == config::VerifySwaps::kSampled && w.host_ids[i] % config::kVerifySampleEvery != 0) continue;
    // None kept: the block was written before this process (a restarted daemon) or unsampled.
    if (swap_in && cache_.pool->checksums(w.host_ids[i]).size() != targets) continue;
    v.device.push_back(w.device_ids[i]);
    v.host.push_back(w.host_ids[i]);
  }
  return v;
}

void SwapLanes::keep_checksums(const VerifiedBlocks& v, std::span<const std::uint64_t> sums,
                                      std::size_t targets) {
  const std::size_t n = v.device.size();
  std::vector<std::uint64_t> per_block(targets);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t t = 0; t < targets; ++t) per_block[t] = sums[t * n + i];
    cache_.pool->set_checksums(v.host[i], per_block);
  }
}

std::optional<SwapLanes::Failure> SwapLanes::check_checksums(
    const VerifiedBlocks& v, std::span<const std::uint64_t> sums, std::size_t targets) const {
  const std::size_t n = v.device.size();
  const std::size_t per_layer = cache_.num_layers == 0 ? 1 : std::max<std::size_t>(1, targets / cache_.num_layers);
  for (std::size_t i = 0; i < n; ++i) {
    const auto kept = cache_.pool->checksums(v.host[i]);
    for (std::size_t t = 0; t < targets; ++t) {
      const std::uint64_t now = sums[t * n + i];
      if (now == kept[t]) continue;
      char text[160];
      std::snprintf(text, sizeof text, "checksum %016" PRIx64 " after the copy, %016" PRIx64 " at swap-out", now, kept[t]);
      return std::pair{TaskStatus::kIntegrity,
                       "rank " + std::to_string(ep_.rank()) + ", layer " + std::to_string(t / per_layer) + " (tensor " +
                           std::to_string(t % per_layer) + " of the layer), host block " + std::to_string(v.host[i]) +
                           " -> device block " + std::to_string(v.device[i]) + ": " + text +
                           ": the host copy changed after it was written; do not use these blocks"};
    }
  }
  return std::nullopt;
}

}  // namespace kvtd::daemon
