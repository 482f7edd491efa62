// --verify-swaps: a swapped-out block's checksums, taken where the device blocks are, stay with its
// host block; after the block comes back in, the device computes them again and a difference
// fails the swap-in (integrity), so the engine never runs on a byte that changed in host memory.
#include <cinttypes>
#include <cstdio>

#include "serve/runner_impl.h"

namespace kvtd::daemon {

void TaskRunner::Impl::verified_pairs(const Work& w, std::vector<std::int32_t>& device,
                                      std::vector<std::int32_t>& host) const {
  device.clear();
  host.clear();
  if (cache.verify_swaps == config::VerifySwaps::kOff || cache.pool == nullptr) return;
  for (std::size_t i = 0; i < w.host_ids.size() && i < w.device_ids.size(); ++i) {
    if (cache.verify_swaps == config::VerifySwaps::kSampled && w.host_ids[i] % config::kVerifySampleEvery != 0) continue;
    device.push_back(w.device_ids[i]);
    host.push_back(w.host_ids[i]);
  }
}

std::string TaskRunner::Impl::keep_checksums(const Work& w, std::span<const kernels::CopyTarget> targets) {
  std::vector<std::int32_t> device, host;
  verified_pairs(w, device, host);
  if (device.empty()) return "";
  auto sums = backend.device_checksums(Direction::kToHost, targets, device);
  if (!sums.ok()) return "checksums of the swapped-out blocks (--verify-swaps): " + sums.error().message;
  const std::size_t n = device.size();
  std::vector<std::uint64_t> per_block(targets.size());
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t t = 0; t < targets.size(); ++t) per_block[t] = (*sums)[t * n + i];
    cache.pool->set_checksums(host[i], per_block);
  }
  return "";
}

std::optional<std::pair<TaskStatus, std::string>> TaskRunner::Impl::check_checksums(
    const Work& w, std::span<const kernels::CopyTarget> targets) {
  std::vector<std::int32_t> device, host, checked_device, checked_host;
  verified_pairs(w, device, host);
  for (std::size_t i = 0; i < device.size(); ++i)
    if (cache.pool->checksums(host[i]).size() == targets.size()) {  // none kept: written before this process
      checked_device.push_back(device[i]);
      checked_host.push_back(host[i]);
    }
  if (checked_device.empty()) return std::nullopt;
  auto sums = backend.device_checksums(Direction::kToDevice, targets, checked_device);
  if (!sums.ok())
    return std::pair{TaskStatus::kDeviceError,
                     "checksums of the swapped-in blocks (--verify-swaps): " + sums.error().message};
  const std::size_t n = checked_device.size();
  const std::size_t per_layer = cache.num_layers == 0 ? 1 : std::max<std::size_t>(1, targets.size() / cache.num_layers);
  for (std::size_t i = 0; i < n; ++i) {
    const auto kept = cache.pool->checksums(checked_host[i]);
    for (std::size_t t = 0; t < targets.size(); ++t) {
      const std::uint64_t now = (*sums)[t * n + i];
      if (now == kept[t]) continue;
      char text[160];
      std::snprintf(text, sizeof text, "checksum %016" PRIx64 " after the copy, %016" PRIx64 " at swap-out", now, kept[t]);
      return std::pair{TaskStatus::kIntegrity,
                       "rank " + std::to_string(ep.rank()) + ", layer " + std::to_string(t / per_layer) + " (tensor " +
                           std::to_string(t % per_layer) + " of the layer), host block " +
                           std::to_string(checked_host[i]) + " -> device block " + std::to_string(checked_device[i]) +
                           ": " + text + ": the host copy changed after it was written; do not use these blocks"};
    }
  }
  return std::nullopt;
}

}  // namespace kvtd::daemon
