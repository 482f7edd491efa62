#include "block_counts.h"

namespace kvtd::daemon {

BlockCounts::BlockCounts(std::int64_t host_blocks, std::int64_t device_blocks) {
  host_.readers.assign(static_cast<std::size_t>(host_blocks), 0);
  host_.writers.assign(static_cast<std::size_t>(host_blocks), 0);
  device_.readers.assign(static_cast<std::size_t>(device_blocks), 0);
  device_.writers.assign(static_cast<std::size_t>(device_blocks), 0);
}

bool BlockCounts::collide(const Side& side, std::span<const std::int32_t> ids, bool reads) {
  for (auto id : ids) {
    const auto b = static_cast<std::size_t>(id);
    if (side.writers[b] || (!reads && side.readers[b])) return true;
  }
  return false;
}

void BlockCounts::count(Side& side, std::span<const std::int32_t> ids, bool reads, int delta) {
  auto& counts = reads ? side.readers : side.writers;
  for (auto id : ids) counts[static_cast<std::size_t>(id)] += static_cast<std::uint32_t>(delta);
}

bool BlockCounts::collides(const TrackedTask& t) const {
  return collide(host_, t.host_ids, t.reads_host) || collide(device_, t.device_ids, t.reads_device);
}

void BlockCounts::count(const TrackedTask& t, int delta) {
  count(host_, t.host_ids, t.reads_host, delta);
  count(device_, t.device_ids, t.reads_device, delta);
}

}  // namespace kvtd::daemon
