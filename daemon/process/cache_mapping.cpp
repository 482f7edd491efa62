#include "cache_mapping.h"

#include <chrono>
#include <thread>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/shared_object.h"

namespace kvtd::daemon {

bool registered_none(const endpoint::RankEndpoint& ep) {
  const auto& g = ep.geometry();
  for (const auto [l, kind] : proto::tensors_of(g))
    if (ep.tensor(l, kind) != nullptr) return false;
  return true;
}

bool wait_for_fastdeploy_cache(const config::DaemonConfig& cfg, const endpoint::RankEndpoint& ep,
                               const std::atomic<bool>& stop) {
  const auto& port = cfg.fastdeploy.engine_worker_queue_port;
  if (port.empty()) return true;  // names without FastDeploy's signals: the engine said they exist
  std::int64_t next_log = 0;
  auto sig = FastDeploySignal::open("cache_ready_signal", port, cfg.rank + 1);
  for (;;) {
    if (!sig.ok()) sig = FastDeploySignal::open("cache_ready_signal", port, cfg.rank + 1);  // not made yet
    if (sig.ok() && sig->load(cfg.rank) == 1) return true;
    const std::int64_t now = ipc::monotonic_now_ns();
    if (now >= next_log) {
      KVTD_INFO("waiting for FastDeploy's worker to publish its KV cache ({})",
                sig.ok() ? sig->name() + "[" + std::to_string(cfg.rank) + "] is 0" : sig.error().message);
      next_log = now + 10'000'000'000;
    }
    if (stop.load() || !ep.engine_alive()) return false;
    notify_watchdog();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

Result<AttachedCache, DeviceErrc> attach_cache(const proto::CacheGeometry& g, TensorSource& source, HostPool& pool) {
  AttachedCache c;
  c.pool = &pool;
  c.device_blocks = g.usable_device_blocks();  // ids a swap may use: valid in every layer, extra ones too
  c.host_blocks = g.num_host_blocks;
  c.num_layers = g.num_layers;
  for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
    if (g.has_tensor(static_cast<proto::TensorKind>(k))) c.block_bytes.push_back(g.block_bytes(static_cast<proto::TensorKind>(k)));
  for (const auto [l, kind] : proto::tensors_of(g)) {
    auto dev = source.open(l, kind);
    if (!dev.ok()) return std::move(dev).error();
    std::byte* host = pool.region(l, kind);
    const auto bb = g.block_bytes(kind);
    if (host == nullptr) host = *dev;  // no host blocks: every task fails validation anyway
    // Device tensors are packed; the host side strides by the pool's layout.
    const std::uint64_t hs = host == *dev ? bb : pool.stride(kind);
    c.to_host.push_back(kernels::CopyTarget{*dev, host, bb, bb, hs});
    c.to_device.push_back(kernels::CopyTarget{host, *dev, bb, hs, bb});
    c.storage.device_tensors.push_back(kernels::LayerTensor{*dev, bb, bb});
    c.storage.host_tensors.push_back(kernels::LayerTensor{host, bb, hs});
  }
  c.storage.object_bytes = g.bytes_per_block_all_layers();  // by rank; the server sets the slicing
  if (auto what = source.describe(c.to_host.size()); !what.empty()) KVTD_INFO("{}", what);
  return c;
}

Result<std::unique_ptr<FastDeployOwnedCache>, DeviceErrc> make_fastdeploy_cache(const config::DaemonConfig& cfg,
                                                                               const endpoint::RankEndpoint& ep,
                                                                               TensorMapper& backend) {
  const auto generation = ep.generation();
  auto owned = FastDeployOwnedCache::create(backend, ep.geometry(), cfg.rank, cfg.device_id, [&](std::size_t i) {
    return ipc::session_object_name(generation, "fdcache" + std::to_string(cfg.rank * 4096 + i));
  });
  if (!owned.ok() || cfg.fastdeploy.engine_worker_queue_port.empty()) return owned;
  auto sig = FastDeploySignal::open("cache_ready_signal", cfg.fastdeploy.engine_worker_queue_port, cfg.rank + 1);
  if (!sig.ok()) return std::move(sig).error();
  sig->store(cfg.rank, 1);
  return owned;
}

}  // namespace kvtd::daemon
