#include "kvtd/daemon/host_pool.h"

namespace kvtd::daemon {

Result<HostPool, DeviceErrc> HostPool::allocate(DeviceBackend& backend, const proto::CacheGeometry& g) {
  HostPool pool;
  pool.regions_.assign(std::size_t{g.num_layers} * proto::kTensorKinds, nullptr);
  std::vector<std::size_t> offsets(pool.regions_.size(), 0);
  std::size_t total = 0;
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
      const auto bytes = g.block_bytes(static_cast<proto::TensorKind>(k)) * g.num_host_blocks;
      if (bytes == 0) continue;
      offsets[l * proto::kTensorKinds + k] = total;
      total += (bytes + 4095) / 4096 * 4096;  // page-aligned regions: DMA and memcpy friendly
    }
  auto base = backend.alloc_host(total);
  if (!base.ok()) return std::move(base).error();
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
      if (g.block_bytes(static_cast<proto::TensorKind>(k)) == 0 || g.num_host_blocks == 0) continue;
      pool.regions_[l * proto::kTensorKinds + k] = *base + offsets[l * proto::kTensorKinds + k];
    }
  pool.total_ = total;
  return pool;
}

}  // namespace kvtd::daemon
