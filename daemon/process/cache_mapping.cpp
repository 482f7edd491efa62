#include "cache_mapping.h"

#include <chrono>
#include <cstring>
#include <fmt/format.h>
#include <thread>

#include "kvtd/daemon/engine_memory.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/proto/group_hits.h"

namespace kvtd::daemon {

std::optional<std::string> foreign_process_memory(const proto::TensorDesc& d, std::uint32_t engine_pid,
                                                  bool engine_in_our_pid_namespace,
                                                  const std::function<bool(std::uint32_t)>& maps_session) {
  const auto* raw = reinterpret_cast<const char*>(d.handle);
  const std::string_view name(raw, strnlen(raw, sizeof d.handle));
  const auto pid = engine_memory_pid(name);
  if (!pid) return std::nullopt;
  // A pid names the engine only in its own pid namespace: here /proc/<pid> is someone else (or
  // nobody), whatever the number says.
  if (!engine_in_our_pid_namespace)
    return fmt::format("tensor object {} names a process by pid, and the engine runs in another pid namespace, where "
                       "/proc/{} is not the engine: run the daemon in the engine's pid namespace (a pod with "
                       "shareProcessNamespace: true) to map the engine's memory by its descriptor",
                       name, *pid);
  if (*pid != engine_pid)
    return fmt::format("tensor object {} is not the memory of the engine that made the session (pid {}): a daemon "
                       "maps no other process's memory",
                       name, engine_pid);
  // The session's creator pid is what the engine wrote; the session's mapping in that process is
  // what the kernel says.
  if (!maps_session(*pid))
    return fmt::format("tensor object {} names process {}, which does not map this session: the session's creator "
                       "pid names another process than the engine, and a daemon maps no other process's memory",
                       name, *pid);
  return std::nullopt;
}

bool registered_none(const endpoint::RankEndpoint& ep) {
  for (std::uint32_t l = 0; l < ep.geometry().num_layers; ++l)
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
      if (ep.tensor(l, static_cast<proto::TensorKind>(k)) != nullptr) return false;
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
                sig.ok() ? fmt::format("{}[{}] is 0", sig->name(), cfg.rank) : sig.error().message);
      next_log = now + 10'000'000'000;
    }
    if (stop.load() || !ep.engine_alive()) return false;
    notify_watchdog();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

namespace {

// Pairs one device tensor (block bytes bb) with its host-pool region and adds both directions.
void add_target(GroupCache& c, std::byte* dev, std::byte* host, std::uint64_t bb, std::uint64_t host_stride) {
  if (host == nullptr) {
    host = dev;  // no host blocks: every task fails validation anyway
    host_stride = bb;
  }
  // Device tensors are packed; the host side strides by the pool's layout.
  c.to_host.push_back(kernels::CopyTarget{dev, host, bb, bb, host_stride});
  c.to_device.push_back(kernels::CopyTarget{host, dev, bb, host_stride, bb});
}

Result<AttachedCache, DeviceErrc> attach_single(const proto::CacheGeometry& g, TensorSource& source, HostPool& pool) {
  AttachedCache out;
  GroupCache c;
  c.pool = &pool;
  c.device_blocks = g.usable_device_blocks();  // ids a swap may use: valid in every layer, extra ones too
  c.host_blocks = g.num_host_blocks;
  c.num_layers = g.num_layers;
  for (std::uint32_t l = 0; l < g.num_layers; ++l) c.layers.push_back(l);
  for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
    if (g.has_tensor(static_cast<proto::TensorKind>(k))) c.block_bytes.push_back(g.block_bytes(static_cast<proto::TensorKind>(k)));
  for (const auto [l, kind] : proto::tensors_of(g)) {
    KVTD_ASSIGN_OR_RETURN(std::byte* const dev, source.open(l, kind));
    std::byte* host = pool.region(l, kind);
    const auto bb = g.block_bytes(kind);
    add_target(c, dev, host, bb, host == nullptr ? bb : pool.stride(kind));
    out.storage.device_tensors.push_back(kernels::LayerTensor{dev, bb, bb});
    out.storage.host_tensors.push_back(kernels::LayerTensor{host == nullptr ? dev : host, bb,
                                                            host == nullptr ? bb : pool.stride(kind)});
  }
  out.storage.object_bytes = g.bytes_per_block_all_layers();  // by rank; the server sets the slicing
  out.device_blocks = c.device_blocks;
  out.host_blocks = c.host_blocks;
  out.groups.push_back(std::move(c));
  return out;
}

// One GroupCache per cache group: its layers in order, each layer's slots of the group (its
// tensors, kvtd/proto/group_slots.h), paired with the group's own pool (pool layer = the group's
// layer index).
Result<AttachedCache, DeviceErrc> attach_groups(const proto::CacheGroups& gs, TensorSource& source,
                                                const HostPools& pools) {
  AttachedCache out;
  out.group_session = true;
  const proto::GroupIdSpace ids = proto::id_space(gs);
  const proto::GroupSizes sizes = proto::group_sizes(gs);
  for (std::uint32_t g = 0; g < gs.num_groups; ++g) {
    const proto::CacheGroup& group = gs.groups[g];
    HostPool& pool = *pools.at(g);
    GroupCache c;
    GroupStorage stored;  // the storage tasks' view of the same tensors (its store set by the server)
    stored.pool = &pool;
    stored.device_base = ids.device_base[g];
    stored.host_base = ids.host_base[g];
    stored.trailing = proto::trailing_pages(group, gs.page_tokens);
    stored.replicated = proto::group_replicated(gs, g);
    stored.object_bytes = sizes.block_bytes[g];  // one block of the group, every layer and tensor
    c.pool = &pool;
    c.device_blocks = group.device_blocks;
    c.host_blocks = group.host_blocks;
    c.device_base = ids.device_base[g];
    c.host_base = ids.host_base[g];
    c.num_layers = group.num_layers();
    for (std::uint32_t t = 0; t < group.num_tensors; ++t) c.block_bytes.push_back(proto::group_tensor_block_bytes(group.tensors[t]));
    std::uint32_t local = 0;
    for (std::uint32_t l = 0; l < proto::kMaxLayers; ++l) {
      if (!group.has_layer(l)) continue;
      c.layers.push_back(l);
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
        const proto::GroupSlot at = proto::group_slot(gs, l, k);
        if (at.group != static_cast<std::int32_t>(g)) continue;
        KVTD_ASSIGN_OR_RETURN(std::byte* const dev, source.open(l, static_cast<proto::TensorKind>(k)));
        const auto tensor = static_cast<proto::TensorKind>(at.tensor);
        std::byte* host = pool.region(local, tensor);
        const std::uint64_t bb = c.block_bytes[at.tensor];
        add_target(c, dev, host, bb, pool.stride(tensor));
        stored.device_tensors.push_back(kernels::LayerTensor{dev, bb, bb});
        stored.host_tensors.push_back(host == nullptr ? kernels::LayerTensor{dev, bb, bb}
                                                      : kernels::LayerTensor{host, bb, pool.stride(tensor)});
      }
      ++local;
    }
    out.groups.push_back(std::move(c));
    out.storage.groups.push_back(std::move(stored));
  }
  out.storage.layout = gs;
  out.device_blocks = ids.device_blocks();
  out.host_blocks = ids.host_blocks();
  return out;
}

}  // namespace

Result<AttachedCache, DeviceErrc> attach_cache(const proto::CacheGeometry& g, const proto::CacheGroups& gs,
                                               TensorSource& source, const HostPools& pools) {
  auto c = proto::is_group_session(gs) ? attach_groups(gs, source, pools) : attach_single(g, source, *pools.at(0));
  if (!c.ok()) return c;
  std::size_t tensors = 0;
  for (const auto& group : c->groups) tensors += group.to_host.size();
  if (auto what = source.describe(tensors); !what.empty()) KVTD_INFO("{}", what);
  return c;
}

Result<std::unique_ptr<FastDeployOwnedCache>, DeviceErrc> make_fastdeploy_cache(const config::DaemonConfig& cfg,
                                                                               const endpoint::RankEndpoint& ep,
                                                                               TensorMapper& backend) {
  const auto generation = ep.generation();
  auto owned = FastDeployOwnedCache::create(backend, ep.geometry(), cfg.rank, cfg.device_id, [&](std::size_t i) {
    return ipc::session_object_name(generation, fmt::format("fdcache{}", cfg.rank * 4096 + i));
  });
  if (!owned.ok() || cfg.fastdeploy.engine_worker_queue_port.empty()) return owned;
  KVTD_ASSIGN_OR_RETURN(auto sig,
                        FastDeploySignal::open("cache_ready_signal", cfg.fastdeploy.engine_worker_queue_port, cfg.rank + 1));
  sig.store(cfg.rank, 1);
  return owned;
}

}  // namespace kvtd::daemon
