#include "start_up.h"

#include <fmt/format.h>
#include <thread>

#include "kvtd/daemon/exit_codes.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/daemon/log.h"
#include "kvtd/events/kv_events.h"
#include "kvtd/listeners/descriptors.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/storage/file_store.h"
#include "kvtd/storage/object_name.h"
#include "kvtd/storage/redis_store.h"

namespace kvtd::daemon {
namespace {

// The storage tier named by the flags, or null for --storage-backend none. A store that cannot
// be opened (unwritable path, bad password file) stops start-up; a Redis server that is down is
// not an error here: its tasks fail with storage_unavailable until it is back.
struct OpenedStore {
  std::unique_ptr<storage::ObjectStore> store;
  // Redis: the same servers on connections of the probe's own, so a probe that times out never
  // drops a task's connection or arms its reconnect backoff. Null: the probe asks `store`.
  std::unique_ptr<storage::ObjectStore> probe;
  std::string name;
};

// What one namespace of the store holds: its fingerprint, its objects' bytes and its share of
// --storage-capacity-gib.
struct Namespace {
  std::uint64_t fingerprint = 0;
  std::uint64_t object_bytes = 0;
  double capacity_share = 1.0;
};

Result<OpenedStore, config::ConfigErrc> open_store(const config::DaemonConfig& cfg, const Namespace& ns,
                                                   events::KvEventPublisher* kv_events) {
  const auto& sc = cfg.storage;
  OpenedStore out;
  if (sc.backend == config::StorageBackendKind::kNone) return out;
  storage::StoreOptions so;
  so.model_id = cfg.model_id;
  so.layout_fingerprint = ns.fingerprint;
  so.object_bytes = ns.object_bytes;
  if (sc.backend == config::StorageBackendKind::kFile) {
    storage::FileStoreOptions fo;
    fo.store = so;
    fo.root = sc.path;
    fo.direct_reads = sc.direct_reads;
    if (kv_events != nullptr)
      fo.on_evict = [kv_events, prefix = sc.key_prefix](const std::string& name) {
        if (auto ours = storage::StoredName::parse(name, prefix)) kv_events->removed({ours->key});
      };
    fo.capacity_bytes = static_cast<std::uint64_t>(sc.capacity_gib * ns.capacity_share * static_cast<double>(1ull << 30));
    fo.sync = sc.fsync == config::StorageFsync::kNone   ? storage::SyncPolicy::kNone
              : sc.fsync == config::StorageFsync::kData ? storage::SyncPolicy::kData
                                                        : storage::SyncPolicy::kFull;
    auto s = storage::open_file_store(fo);
    if (!s.ok()) return make_error(config::ConfigErrc::kInvalidValue, "--storage-path " + sc.path + ": " + s.error().message);
    out.store = std::move(s).value();
    out.name = "file store " + sc.path;
    return out;
  }
  storage::RedisStoreOptions ro;
  ro.store = so;
  ro.endpoints = sc.redis_endpoints;
  ro.detect_cluster = true;
  ro.password_file = sc.redis_password_file;
  if (sc.redis_password_file.empty() && std::getenv(sc.redis_password_env.c_str()) != nullptr)
    ro.password_env = sc.redis_password_env;
  ro.timeout_ms = static_cast<std::int64_t>(sc.redis_timeout_s * 1000);
  ro.ttl_s = sc.redis_ttl_s;
  auto s = storage::open_redis_store(ro);
  if (!s.ok()) return make_error(config::ConfigErrc::kInvalidValue, "--redis-endpoints: " + s.error().message);
  out.store = std::move(s).value();
  auto probe = storage::open_redis_store(ro);
  if (!probe.ok()) return make_error(config::ConfigErrc::kInvalidValue, "--redis-endpoints: " + probe.error().message);
  out.probe = std::move(probe).value();
  out.name = fmt::format("redis {}{}", sc.redis_endpoints.front(),
                         sc.redis_endpoints.size() > 1 ? fmt::format(" (+{})", sc.redis_endpoints.size() - 1) : "");
  return out;
}

// The stores of this rank: one namespace for a single-shape cache; one per cache group (its
// objects one block of the group, --storage-capacity-gib shared by their bytes per key).
std::optional<int> open_stores(const config::DaemonConfig& cfg, Services& s) {
  std::vector<Namespace> spaces;
  // What a worker's staging slice must hold: a key's objects (one group's object at a time).
  std::uint64_t staged = s.geometry.bytes_per_block_all_layers();
  if (proto::is_group_session(s.groups)) {
    const proto::GroupSizes sizes = proto::group_sizes(s.groups);
    std::uint64_t key_bytes = 0;
    staged = 0;
    for (std::uint32_t g = 0; g < s.groups.num_groups; ++g) {
      key_bytes += sizes.block_bytes[g];
      staged = std::max(staged, sizes.block_bytes[g]);
    }
    for (std::uint32_t g = 0; g < s.groups.num_groups; ++g)
      spaces.push_back(Namespace{group_fingerprint(s.groups, g, cfg.kv_identity), sizes.block_bytes[g],
                                 static_cast<double>(sizes.block_bytes[g]) / static_cast<double>(key_bytes)});
  } else {
    spaces.push_back(Namespace{layout_fingerprint(s.geometry, s.slicing, cfg.kv_identity), staged / s.slicing.parts, 1.0});
  }
  if (cfg.storage.backend == config::StorageBackendKind::kNone) return std::nullopt;
  if (auto why = staging_problem(cfg.storage, staged); !why.empty()) {
    KVTD_ERROR("storage: {}", why);
    return kExitBadFlags;
  }
  for (std::size_t i = 0; i < spaces.size(); ++i) {
    auto store = open_store(cfg, spaces[i], s.kv_events.get());
    if (!store.ok()) {
      KVTD_ERROR("storage: {}", store.error().message);
      return kExitBadFlags;
    }
    if (i != 0) {
      s.group_stores.push_back(std::move(store->store));
      continue;
    }
    s.store = std::move(store->store);
    s.probe_store = std::move(store->probe);
    s.store_name = store->name;
  }
  return std::nullopt;
}

// The backend the flags name. CUDA's default scatter mode falls back to the copy kernel when this
// build's runtime has no cudaMemcpyBatchAsync.
Result<std::unique_ptr<DeviceBackend>, DeviceErrc> open_backend(const config::DaemonConfig& cfg) {
  if (cfg.device_backend != config::DeviceBackendKind::kCuda) return make_host_backend();
  auto b = make_cuda_backend(cfg.device_id, cfg.scatter_mode, cfg.copy_batch_max, cfg.copy_wait_spin_us);
  if (!b.ok() && !cfg.scatter_mode_given && cfg.scatter_mode == ScatterMode::kBatch &&
      b.error().message.find("cudaMemcpyBatchAsync") != std::string::npos) {
    KVTD_INFO("this build has no cudaMemcpyBatchAsync: scattered blocks go through the copy kernel");
    b = make_cuda_backend(cfg.device_id, ScatterMode::kKernelAllLayers, cfg.copy_batch_max,
                          cfg.copy_wait_spin_us);
  }
  return b;
}

// --kv-events-endpoint: rank 0 publishes for its group (every rank would say the same, and a
// router wants one voice per engine); the others only say so.
std::optional<int> open_kv_events(const config::DaemonConfig& cfg, Services& s) {
  const auto& e = cfg.kv_events;
  if (e.endpoint.empty()) return std::nullopt;
  if (cfg.rank != 0) {
    KVTD_INFO("KV events: rank 0 of this group publishes them on {}", e.endpoint);
    return std::nullopt;
  }
  events::KvEventsOptions o;
  o.endpoint = e.endpoint;
  o.format = *events::parse_kv_events_format(e.format);  // checked by the flags
  o.topic = e.topic;
  o.medium = e.medium;
  o.locality = e.locality == "none" ? "" : e.locality;
  // Tokens per stored key: a block's, or a session of cache groups' page.
  o.block_size = proto::is_group_session(cfg.cache_groups) ? cfg.cache_groups.page_tokens
                                                            : static_cast<std::uint32_t>(cfg.key_cache_shape[2]);
  o.data_parallel_rank = cfg.data_parallel_id;
  auto p = events::KvEventPublisher::open(o);
  if (!p.ok()) {
    KVTD_ERROR("{}", p.error().message);
    return kExitBadFlags;
  }
  s.kv_events = std::move(p).value();
  KVTD_INFO("KV events ({} layout, medium {}, locality {}) on {}", e.format, e.medium, e.locality,
            s.kv_events->endpoint());
  return std::nullopt;
}

// Logs the host pool's size and /dev/shm's room for it. Only a warning: a daemon restarted within
// a session re-maps the pool it already has, which needs no new space; HostPool::open refuses
// (exit 5) when it must create a pool that does not fit.
void log_pool_room(const config::DaemonConfig& cfg, const Services& s) {
  std::uint64_t pool_bytes = 0;
  std::string blocks;
  const std::vector<PoolShape> shapes = PoolShape::of_session(s.geometry, s.groups);
  for (std::uint32_t g = 0; g < shapes.size(); ++g) {
    pool_bytes += HostPool::object_bytes(shapes[g], cfg.host_layout);
    blocks += proto::is_group_session(s.groups)
                  ? fmt::format("{}group {} ({}): {} blocks x {} bytes", g == 0 ? "" : ", ", g,
                                proto::group_kind_name(s.groups.groups[g].group_kind()), shapes[g].num_host_blocks,
                                shapes[g].block_bytes_all_layers())
                  : fmt::format("{} blocks x {} bytes per block, all layers", shapes[g].num_host_blocks,
                                shapes[g].block_bytes_all_layers());
  }
  const std::int64_t shm_free = cfg.host_pool_hugepages ? -1 : ipc::shm_free_bytes();
  // In huge pages, HostPool::open checks the kernel's free pages and names the counts.
  const std::string room = cfg.host_pool_hugepages
                               ? "in huge pages under " + cfg.hugetlbfs_dir
                               : fmt::format("/dev/shm has {:.1f} MiB free", static_cast<double>(shm_free) / (1 << 20));
  KVTD_INFO("kvtd {}rank {}/{} device {} backend={} host pool {:.1f} MiB ({}); {}",
            cfg.group.empty() ? std::string() : "group " + cfg.group + " ", cfg.rank, cfg.mp_num, cfg.device_id,
            s.backend->name(), static_cast<double>(pool_bytes) / (1 << 20), blocks, room);
  if (shm_free >= 0 && static_cast<std::uint64_t>(shm_free) < pool_bytes)
    KVTD_WARN("a new host pool needs {:.1f} MiB in /dev/shm but only {:.1f} MiB are free: unless this rank's "
              "pool of the session exists already, attaching will fail; enlarge /dev/shm (mount -o "
              "remount,size=... /dev/shm) or lower --num-host-blocks",
              static_cast<double>(pool_bytes) / (1 << 20), static_cast<double>(shm_free) / (1 << 20));
}

// The metrics server (when --metrics-port) and the control socket (status, drain, log-level,
// clear, restore: control_handler.cpp).
std::optional<int> open_servers(const config::DaemonConfig& cfg, std::atomic<bool>& stop, Services& s) {
  if (s.store) {
    // Every namespace of this rank (a group session's one per cache group) counts.
    s.registry.set_store_figures([stores = s.stores()] {
      metrics::MetricsRegistry::StoreFigures f{};
      f.sized = true;
      for (const storage::ObjectStore* store : stores) {
        const auto st = store->stats();
        f.puts += st.puts;
        f.put_failures += st.put_failures;
        f.hits += st.hits;
        f.misses += st.misses;
        f.corrupt += st.corrupt;
        f.evictions += st.evictions;
        f.sized = f.sized && st.sized;
        f.bytes_stored += st.bytes_stored;
        f.objects_stored += st.objects_stored;
      }
      return f;
    });
  }
  if (const events::KvEventPublisher* events = s.kv_events.get())
    s.registry.set_kv_event_figures([events] {
      const auto st = events->stats();
      return metrics::MetricsRegistry::KvEventFigures{st.events_sent, st.events_dropped};
    });
  if (s.store)
    s.registry.set_store_tier(cfg.storage.backend == config::StorageBackendKind::kFile ? "file" : "redis");
  // Readiness asks whether the store answers; a thread asks it every few seconds so that a
  // probe never waits on the store.
  if (s.store) s.store_probe = std::make_unique<StoreProbe>(s.probe_store ? *s.probe_store : *s.store, kStoreProbePeriodMs);
  const HealthSources sources{s.registry, s.control_state, s.store_probe.get(), s.store_name, s.backend.get(),
                              static_cast<std::int64_t>(cfg.stuck_copy_timeout_s * 1e9)};
  s.registry.set_health_figures([sources] {
    const StoreProbe::Answer store = sources.store ? sources.store->last() : StoreProbe::Answer{};
    const std::int64_t copy_ns = sources.copies ? StuckCopyWatch::running_ns(*sources.copies) : 0;
    return metrics::MetricsRegistry::HealthFigures{readiness(sources).ok, sources.store != nullptr,
                                                   store.checked && store.reachable, static_cast<double>(copy_ns) / 1e9};
  });
  if (cfg.metrics_port != 0) {
    auto ms = metrics::MetricsServer::start(s.registry, cfg.metrics_port, health_routes(sources), cfg.metrics_address);
    if (!ms.ok()) {
      KVTD_ERROR("{}", ms.error().message);
      return kExitBadFlags;
    }
    s.metrics_server = std::move(ms).value();
    KVTD_INFO("Prometheus metrics on http://{}:{}/metrics, health probes on /healthz and /readyz", cfg.metrics_address,
              s.metrics_server->port());
  }
  auto control = start_control(cfg, s.registry, s.store_name, s.control_state, stop, health_routes(sources),
                               s.stores(), s.kv_events.get());
  if (!control.ok() && control.error().code != control::ControlErrc::kInUse) {
    KVTD_ERROR("{}", control.error().message);
    return kExitBadFlags;
  }
  if (control.ok()) {
    s.control = std::move(control).value();
    KVTD_INFO("control socket {}{}", s.control->endpoint(),
              cfg.control_endpoint.empty() ? "" : " and " + cfg.control_endpoint);
  } else {  // another daemon of this rank runs: attaching will refuse us (exit 3) naming it
    KVTD_WARN("{}", control.error().message);
  }
  return std::nullopt;
}

}  // namespace

// Below this many descriptors a flood of every listener's cap would leave too little reserve.
constexpr std::uint64_t kMinDescriptors = 4096;

// Raises the descriptor limit to the hard one: every listener caps its connections far below it,
// so the rest stays in reserve for the store, shared memory and sessions (systemd's soft 1,024
// ran out under ~1,100 connections to the control port).
void reserve_descriptors() {
  auto lim = listeners::raise_descriptor_limit();
  if (!lim.ok()) {
    KVTD_WARN("descriptors: {}; keeping the current limit", lim.error().message);
    return;
  }
  if (lim->now != lim->was) KVTD_INFO("descriptors: soft limit raised from {} to {}", lim->was, lim->now);
  if (lim->now < kMinDescriptors)
    KVTD_WARN("descriptors: the limit is {} (hard limit); set LimitNOFILE= to at least {} (the unit sets 65536)",
              lim->now, kMinDescriptors);
}

std::optional<int> start_up(const config::DaemonConfig& cfg, std::atomic<bool>& stop, Services& s) {
  reserve_descriptors();
  // Host pools in huge pages are files in the hugetlbfs mount: what a dead session left there holds
  // pages no one else can have, so they are swept too.
  const std::vector<std::string> pool_dirs =
      cfg.host_pool_hugepages ? std::vector<std::string>{cfg.hugetlbfs_dir} : std::vector<std::string>{};
  for (const auto& n : ipc::sweep_stale_objects(pool_dirs)) KVTD_INFO("removed stale shared-memory object {}", n);
  if (cfg.host_pool_hugepages) {
    if (auto page = HostPool::hugetlbfs_page_bytes(cfg.hugetlbfs_dir); !page.ok()) {
      KVTD_ERROR("{}", page.error().message);
      return kExitBadFlags;
    }
  }
  auto backend = open_backend(cfg);
  if (!backend.ok()) {
    KVTD_ERROR("--device-backend cuda: {}", backend.error().message);
    return kExitBackend;
  }
  s.backend = std::move(backend).value();
  if (cfg.stuck_copy_timeout_s > 0)
    s.stuck_copy_watch =
        std::make_unique<StuckCopyWatch>(*s.backend, static_cast<std::int64_t>(cfg.stuck_copy_timeout_s * 1e9));
  s.numa_node = cfg.numa_node == config::kNumaAuto ? s.backend->numa_node() : cfg.numa_node;
  KVTD_INFO("NUMA: {}", s.numa_node >= 0 ? fmt::format("host pool and copy threads on node {}", s.numa_node)
                                          : std::string("no node to bind to (--numa-node ") +
                                                (cfg.numa_node == -1 ? "none)" : "auto, and the backend knows none)"));
  s.geometry = cfg.geometry();
  s.groups = cfg.cache_groups;
  if (auto why = cfg.object_slicing(&s.slicing); !why.empty()) {  // checked with the flags already
    KVTD_ERROR("{}", why);
    return kExitBadFlags;
  }
  log_pool_room(cfg, s);
  if (auto failed = open_kv_events(cfg, s)) return failed;
  if (auto failed = open_stores(cfg, s)) return failed;
  if (s.store && proto::is_group_session(s.groups)) {
    for (std::uint32_t g = 0; g < s.groups.num_groups; ++g)
      KVTD_INFO("storage: cache group {} ({}) in {} (model {}, layout fingerprint {:016x}, {} bytes per object, {})", g,
                proto::group_kind_name(s.groups.groups[g].group_kind()), s.store_name, cfg.model_id,
                group_fingerprint(s.groups, g, cfg.kv_identity), proto::group_sizes(s.groups).block_bytes[g],
                proto::group_replicated(s.groups, g) ? "one copy for every TP size, rank 0 writes" : "by rank");
  } else if (s.store) {
    KVTD_INFO("storage: {} (model {}, layout fingerprint {:016x}, weight version {}, {}), write policy {}, {} I/O "
              "threads, {} MiB staging, {} reads",
              s.store_name, cfg.model_id, layout_fingerprint(s.geometry, s.slicing, cfg.kv_identity), cfg.storage.weight_version,
              s.slicing.replicated ? "one copy for every TP size (replicated cache)"
              : s.slicing.by_head  ? fmt::format("{} objects of {} KV heads per block, any TP size", s.slicing.parts,
                                                 s.slicing.heads_per_part)
                                   : std::string("one object per rank's slice, this TP size only"),
              static_cast<int>(cfg.storage.write_policy),
              storage_io_threads(cfg.storage, s.geometry.bytes_per_block_all_layers(), std::thread::hardware_concurrency()),
              cfg.storage.staging_mib,
              cfg.storage.direct_reads ? "direct (O_DIRECT, io_uring)" : "buffered (page cache)");
  }
  return open_servers(cfg, stop, s);
}

}  // namespace kvtd::daemon
