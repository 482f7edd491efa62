#include "kvtd/base/mutex.h"
#include "kvtd/daemon/daemon_main.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "serve/cleared_cache.h"
#include "serve/completion.h"
#include "process/fastdeploy_ipc.h"
#include "kvtd/daemon/control_handler.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/daemon/task_runner.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/metrics/http_server.h"
#include "kvtd/storage/file_store.h"
#include "kvtd/storage/redis_store.h"

namespace kvtd::daemon {
namespace {

// Whether the engine registered no tensor of this rank: then FastDeploy's worker published them
// by name (fastdeploy_ipc.h). A registry with some tensors but not all is the engine's error,
// reported by attach_cache naming the first one missing.
bool registered_none(const endpoint::RankEndpoint& ep) {
  const auto& g = ep.geometry();
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
      if (ep.tensor(l, static_cast<proto::TensorKind>(k)) != nullptr) return false;
  return true;
}

// With FastDeploy's flags, waits until FastDeploy's worker says its KV cache exists
// (cache_ready_signal.<port>[rank] == 1: worker/gpu_model_runner.py sets it after set_data_ipc of
// every layer), as FastDeploy's own transfer manager does (_init_gpu_cache). The heartbeat runs
// meanwhile. False when asked to stop or the engine went away.
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

// Where this rank's tensors come from: the engine's registry; or, when the engine registered
// none, FastDeploy's names: the tensors FastDeploy's worker published, or (--create_cache_tensor)
// the cache this daemon made and published itself.
class TensorSource {
 public:
  TensorSource(endpoint::RankEndpoint& ep, DeviceBackend& backend, std::int32_t device_id, bool by_names,
               const FastDeployOwnedCache* owned)
      : ep_(ep), backend_(backend), device_id_(device_id), owned_(owned), by_names_(by_names) {}

  // The device address of the tensor's first byte.
  Result<std::byte*, DeviceErrc> open(std::uint32_t l, proto::TensorKind kind) {
    if (by_names_ && owned_ != nullptr) return owned_->tensor(l, kind);
    const proto::TensorDesc* d = ep_.tensor(l, kind);
    proto::TensorDesc named{};
    if (by_names_) {
      auto r = read_fastdeploy_tensor(ep_.geometry(), ep_.rank(), l, kind, device_id_);
      if (!r.ok()) return std::move(r).error();
      named = *r;
      d = &named;
    }
    if (!d)
      return make_error(DeviceErrc::kOpenFailed, std::string(proto::tensor_kind_name(kind)) + " tensor of layer " +
                                                     std::to_string(l) + " is not registered");
    return backend_.open_tensor(*d);
  }

  std::string describe(std::size_t tensors) const {
    if (!by_names_) return "";
    const auto example = fastdeploy_tensor_name(proto::TensorKind::kKey, 0, ep_.rank(), device_id_);
    return owned_ != nullptr ? "made the " + std::to_string(tensors) + " tensors of this rank's cache and published " +
                                   "them by FastDeploy's names for its worker (e.g. " + example + ")"
                             : "the engine registered no tensors: opened the " + std::to_string(tensors) +
                                   " tensors FastDeploy's worker published by name (e.g. " + example + ")";
  }

 private:
  endpoint::RankEndpoint& ep_;
  DeviceBackend& backend_;
  std::int32_t device_id_;
  const FastDeployOwnedCache* owned_;
  bool by_names_;
};

// Maps every tensor of this rank and pairs it with its host-pool region.
Result<AttachedCache, DeviceErrc> attach_cache(const proto::CacheGeometry& g, TensorSource& source, HostPool& pool) {
  AttachedCache c;
  c.pool = &pool;
  c.device_blocks = g.usable_device_blocks();  // ids a swap may use: valid in every layer, extra ones too
  c.host_blocks = g.num_host_blocks;
  c.num_layers = g.num_layers;
  for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
    if (g.has_tensor(static_cast<proto::TensorKind>(k))) c.block_bytes.push_back(g.block_bytes(static_cast<proto::TensorKind>(k)));
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
      const auto kind = static_cast<proto::TensorKind>(k);
      if (!g.has_tensor(kind)) continue;
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
  c.storage.object_bytes = g.bytes_per_block_all_layers();
  c.storage.replicated = !g.has_value();
  if (auto what = source.describe(c.to_host.size()); !what.empty()) KVTD_INFO("{}", what);
  return c;
}

// FastDeploy's --create_cache_tensor: makes this rank's cache, publishes it by FastDeploy's names
// and tells FastDeploy's worker (cache_ready_signal[rank] = 1), as its transfer manager does.
Result<std::unique_ptr<FastDeployOwnedCache>, DeviceErrc> make_fastdeploy_cache(const config::DaemonConfig& cfg,
                                                                               const endpoint::RankEndpoint& ep,
                                                                               DeviceBackend& backend) {
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

// The storage tier named by the flags, or null for --storage-backend none. A store that cannot
// be opened (unwritable path, bad password file) stops start-up; a Redis server that is down is
// not an error here: its tasks fail with storage_unavailable until it is back.
struct OpenedStore {
  std::unique_ptr<storage::ObjectStore> store;
  std::string name;
};

Result<OpenedStore, config::ConfigErrc> open_store(const config::DaemonConfig& cfg, const proto::CacheGeometry& g) {
  const auto& sc = cfg.storage;
  OpenedStore out;
  if (sc.backend == config::StorageBackendKind::kNone) return out;
  storage::StoreOptions so;
  so.model_id = cfg.model_id;
  so.layout_fingerprint = layout_fingerprint(g);
  so.object_bytes = g.bytes_per_block_all_layers();
  if (auto why = staging_problem(sc, so.object_bytes); !why.empty())
    return make_error(config::ConfigErrc::kInvalidValue, why);
  if (sc.backend == config::StorageBackendKind::kFile) {
    storage::FileStoreOptions fo;
    fo.store = so;
    fo.root = sc.path;
    fo.capacity_bytes = static_cast<std::uint64_t>(sc.capacity_gib * static_cast<double>(1ull << 30));
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
  auto s = storage::open_redis_store(ro);
  if (!s.ok()) return make_error(config::ConfigErrc::kInvalidValue, "--redis-endpoints: " + s.error().message);
  out.store = std::move(s).value();
  out.name = "redis " + sc.redis_endpoints.front() + (sc.redis_endpoints.size() > 1 ? " (+" + std::to_string(sc.redis_endpoints.size() - 1) + ")" : "");
  return out;
}

// The rank's heartbeat in the session from the grant on. Until serving() it also pings the
// systemd watchdog: the set-up between grant and READY (mapping tensors, creating and pinning
// the host pool) can outlast WatchdogSec. Once serving, only the dispatcher pings.
class Heartbeat {
 public:
  Heartbeat(endpoint::RankEndpoint& ep, std::int64_t period_ns) : ep_(ep), period_ns_(period_ns) {
    thread_ = std::thread([this] { loop(); });
  }
  void serving() { setting_up_.store(false, std::memory_order_relaxed); }
  ~Heartbeat() {
    {
      MutexLock g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void loop() {
    MutexLock lk(mu_);
    while (!stop_) {
      ep_.heartbeat();
      if (setting_up_.load(std::memory_order_relaxed)) notify_watchdog();
      cv_.wait_for(lk, std::chrono::nanoseconds(period_ns_));
    }
  }
  endpoint::RankEndpoint& ep_;
  std::int64_t period_ns_;
  Mutex mu_;
  CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::atomic<bool> setting_up_{true};
  std::thread thread_;
};

}  // namespace

int run_daemon(const config::DaemonConfig& cfg, std::atomic<bool>& stop) {
  for (const auto& n : ipc::sweep_stale_objects()) KVTD_INFO("removed stale shared-memory object {}", n);
  std::unique_ptr<DeviceBackend> backend;
  if (cfg.device_backend == config::DeviceBackendKind::kCuda) {
    auto b = make_cuda_backend(cfg.device_id, cfg.scatter_mode);
    if (!b.ok() && !cfg.scatter_mode_given && cfg.scatter_mode == config::ScatterMode::kBatch &&
        b.error().message.find("cudaMemcpyBatchAsync") != std::string::npos) {
      KVTD_INFO("this build has no cudaMemcpyBatchAsync: scattered blocks go through the copy kernel");
      b = make_cuda_backend(cfg.device_id, config::ScatterMode::kKernelAllLayers);
    }
    if (!b.ok()) {
      KVTD_ERROR("--device-backend cuda: {}", b.error().message);
      return kExitBackend;
    }
    backend = std::move(b).value();
  } else {
    backend = make_host_backend();
  }
  const int numa_node = cfg.numa_node == config::kNumaAuto ? backend->numa_node() : cfg.numa_node;
  KVTD_INFO("NUMA: {}", numa_node >= 0 ? "host pool and copy threads on node " + std::to_string(numa_node)
                                        : std::string("no node to bind to (--numa-node ") +
                                              (cfg.numa_node == -1 ? "none)" : "auto, and the backend knows none)"));
  const auto geometry = cfg.geometry();
  const std::uint64_t pool_bytes = HostPool::object_bytes(geometry, cfg.host_layout);
  const std::int64_t shm_free = ipc::shm_free_bytes();
  KVTD_INFO("kvtd rank {}/{} backend={} host pool {:.1f} MiB ({} blocks x {} bytes per block, all layers); /dev/shm "
            "has {:.1f} MiB free",
            cfg.rank, cfg.mp_num, backend->name(), static_cast<double>(pool_bytes) / (1 << 20), cfg.num_host_blocks,
            geometry.bytes_per_block_all_layers(), static_cast<double>(shm_free) / (1 << 20));
  // Only a warning here: a daemon restarted within a session re-maps the pool it already has, which
  // needs no new space. HostPool::open refuses (exit 5) when it must create a pool that does not fit.
  if (shm_free >= 0 && static_cast<std::uint64_t>(shm_free) < pool_bytes)
    KVTD_WARN("a new host pool needs {:.1f} MiB in /dev/shm but only {:.1f} MiB are free: unless this rank's "
              "pool of the session exists already, attaching will fail; enlarge /dev/shm (mount -o "
              "remount,size=... /dev/shm) or lower --num-host-blocks",
              static_cast<double>(pool_bytes) / (1 << 20), static_cast<double>(shm_free) / (1 << 20));

  auto store = open_store(cfg, geometry);
  if (!store.ok()) {
    KVTD_ERROR("storage: {}", store.error().message);
    return kExitBadFlags;
  }
  if (store->store)
    KVTD_INFO("storage: {} (model {}, layout fingerprint {:016x}, weight version {}), write policy {}, {} I/O "
              "threads, {} MiB staging",
              store->name, cfg.model_id, layout_fingerprint(geometry), cfg.storage.weight_version,
              static_cast<int>(cfg.storage.write_policy), cfg.storage.io_threads, cfg.storage.staging_mib);

  // Metrics live for the whole process (counters survive sessions); the server stops before the
  // store it reads goes away (declared after it).
  metrics::MetricsRegistry registry;
  registry.set_store(store->store.get());
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  if (cfg.metrics_port != 0) {
    auto ms = metrics::MetricsServer::start(registry, cfg.metrics_port);
    if (!ms.ok()) {
      KVTD_ERROR("{}", ms.error().message);
      return kExitBadFlags;
    }
    metrics_server = std::move(ms).value();
    KVTD_INFO("Prometheus metrics on http://127.0.0.1:{}/metrics", metrics_server->port());
  }

  // The control socket: status, drain, log-level (daemon/src/control_handler.cpp).
  ControlState control_state;
  auto control = start_control(cfg, registry, store->name, control_state, stop);
  if (!control.ok() && control.error().code != control::ControlErrc::kInUse) {
    KVTD_ERROR("{}", control.error().message);
    return kExitBadFlags;
  }
  if (control.ok())
    KVTD_INFO("control socket {}{}", (*control)->endpoint(),
              cfg.control_endpoint.empty() ? "" : " and " + cfg.control_endpoint);
  else  // another daemon of this rank runs: attaching will refuse us (exit 3) naming it
    KVTD_WARN("{}", control.error().message);

  std::uint64_t last_generation = 0;
  while (!stop.load()) {
    endpoint::EndpointOptions eo;
    eo.suffix = cfg.session_suffix;
    eo.rank = cfg.rank;
    eo.expected = geometry;
    eo.attach_timeout_ns = cfg.attach_timeout_ns();
    eo.engine_timeout_ns = cfg.engine_timeout_ns();
    eo.skip_generation = last_generation;
    eo.stop = &stop;
    eo.on_waiting = [](const std::string& what) { KVTD_INFO("{}", what); };
    eo.on_poll = [] { notify_watchdog(); };
    notify_status("waiting for session");
    KVTD_INFO("waiting for session suffix '{}'", cfg.session_suffix);
    auto ep = endpoint::RankEndpoint::attach(eo);
    if (!ep.ok()) {
      const auto code = ep.error().code;
      if (code == ipc::IpcErrc::kClosed) break;  // stop requested while waiting
      KVTD_ERROR("cannot attach: {}", ep.error().message);
      if (code == ipc::IpcErrc::kTimeout) return kExitAttachTimeout;
      if (code == ipc::IpcErrc::kCorrupt) return kExitSessionCorrupt;
      if (code == ipc::IpcErrc::kSystem || code == ipc::IpcErrc::kNoSpace) return kExitBackend;
      return kExitSessionRefused;
    }
    auto& endpoint = **ep;
    last_generation = endpoint.generation();
    // An operator's clear or restore asked of the previous session is not this one's.
    control_state.clear_requested.store(false);
    control_state.restore_requested.store(false);
    // Heartbeat from the grant on: mapping (or creating) the host pool and opening the tensors can
    // take seconds for large caches, and a granted rank that is silent that long is fenced.
    Heartbeat heartbeat(endpoint, cfg.heartbeat_period_ns());
    notify_status("attached to session " + cfg.session_suffix + "; mapping the cache and the host pool");
    auto pool = HostPool::open(*backend, geometry, endpoint.generation(), cfg.rank, cfg.host_layout, numa_node);
    if (!pool.ok()) {
      KVTD_ERROR("host pool: {}", pool.error().message);
      return kExitBackend;
    }
    if ((*pool)->restored())
      KVTD_INFO("host pool {} re-mapped from a previous daemon of this session: {} of {} blocks hold data",
                (*pool)->name(), (*pool)->valid_blocks(), cfg.num_host_blocks);
    // One pass per mapping of the engine's cache: a weight update (CLEAR_CACHE ... RESTORE_CACHE,
    // or `kvtd ctl clear|restore`) closes it and later maps the re-registered tensors.
    TaskRunner::Exit why = TaskRunner::Exit::kStopped;
    std::optional<proto::TaskRecordHeader> restore_task;  // to complete once serving again
    // --create_cache_tensor: the cache this daemon made for FastDeploy's worker, for as long as
    // it is mapped (freed when a weight update clears it, and when the session ends).
    std::unique_ptr<FastDeployOwnedCache> owned;
    bool live = endpoint.tensors_loaded();
    auto fail_restore = [&](const std::string& message) {
      KVTD_ERROR("cannot restore the cache: {}", message);
      if (!restore_task) return;
      (void)endpoint.complete(completion_record(endpoint.rank(), *restore_task, proto::TaskStatus::kDeviceError, 0, 0,
                                                ipc::monotonic_now_ns(), message));
      restore_task.reset();
    };
    for (;;) {
      if (!live) {
        endpoint.set_ready(proto::kReadyHostPool);
        registry.set_attached(true, endpoint.epoch());
        control_state.attached(endpoint.generation());
        control_state.set_cache(ControlState::Cache::kCleared);
        notify_status("cache cleared for a weight update; waiting for restore");
        KVTD_INFO("cache cleared: holding no mapping of the engine's tensors until restore");
        heartbeat.serving();
        notify_ready();
        const auto out = serve_cleared(endpoint, **pool, stop, &control_state.restore_requested,
                                       [&control_state] { control_state.restore_refused(); });
        if (out.why == ClearedExit::Why::kStopped) break;
        if (out.why == ClearedExit::Why::kSessionLost || out.why == ClearedExit::Why::kRingCorrupt) {
          why = out.why == ClearedExit::Why::kSessionLost ? TaskRunner::Exit::kSessionLost
                                                           : TaskRunner::Exit::kRingCorrupt;
          break;
        }
        restore_task = out.restore_task;
        auto loaded = endpoint.load_tensors();
        if (!loaded.ok() || !*loaded) {
          fail_restore(loaded.ok() ? "the engine's cache state is cleared: it registers its tensors and restores"
                                   : "tensor registry: " + loaded.error().message);
          continue;
        }
      }
      const bool by_names = registered_none(endpoint);
      if (by_names && cfg.fastdeploy.create_cache_tensor && !owned) {
        auto made = make_fastdeploy_cache(cfg, endpoint, *backend);
        if (!made.ok()) {
          KVTD_ERROR("cannot make the KV cache for FastDeploy's worker (--create_cache_tensor): {}",
                     made.error().message);
          if (live) return kExitBackend;
          fail_restore(made.error().message);
          continue;
        }
        owned = std::move(made).value();
      } else if (by_names && !owned && !wait_for_fastdeploy_cache(cfg, endpoint, stop)) {
        why = stop.load() ? TaskRunner::Exit::kStopped : TaskRunner::Exit::kSessionLost;
        break;
      }
      TensorSource source(endpoint, *backend, cfg.device_id, by_names, owned.get());
      auto cache = attach_cache(geometry, source, **pool);
      if (!cache.ok()) {
        backend->close_tensors();
        if (live) {  // the first mapping, right after attach
          KVTD_ERROR("cannot map the cache tensors: {}", cache.error().message);
          return kExitBackend;
        }
        fail_restore(cache.error().message);  // stay cleared; the engine clears and restores again
        continue;
      }
      cache->storage.store = store->store.get();
      cache->storage.store_name = store->name;
      cache->storage.config = cfg.storage;
      cache->numa_node = numa_node;
      cache->metrics = &registry;
      registry.set_host_pool_bytes((*pool)->total_bytes());
      cache->summary_period_ns = static_cast<std::int64_t>(cfg.log_summary_period_s * 1e9);
      cache->storage.numa_node = numa_node;
      auto events = backend->export_layer_events(geometry.num_layers);
      if (!events.ok()) {
        KVTD_ERROR("cannot create the per-layer events: {}", events.error().message);
        backend->close_tensors();
        return kExitBackend;
      }
      endpoint.publish_layer_events(*events);
      TaskRunner runner(endpoint, *backend, std::move(cache).value());
      endpoint.set_ready(proto::kReadyCacheAttached | proto::kReadyHostPool);
      if (restore_task) {
        KVTD_INFO("cache restored (task {}): the re-registered tensors are mapped", restore_task->task_id);
        (void)endpoint.complete(completion_record(endpoint.rank(), *restore_task, proto::TaskStatus::kOk, 0, 0,
                                                  ipc::monotonic_now_ns(), "tensors re-opened"));
        restore_task.reset();
      }
      live = true;
      KVTD_INFO("attached to session generation {:016x} as epoch {}; serving", endpoint.generation(), endpoint.epoch());
      notify_status("serving session " + cfg.session_suffix);
      notify_ready();
      heartbeat.serving();
      registry.set_attached(true, endpoint.epoch());
      control_state.attached(endpoint.generation());
      control_state.set_cache(ControlState::Cache::kLive);  // a clear accepted from here on is kept
      why = runner.run(stop, &control_state.clear_requested);
      const auto st = runner.stats();
      KVTD_INFO("{}: {} tasks ok, {} failed, {} dropped (revoked epoch), {} bytes to host, {} bytes to device; "
                "storage: {} tasks, {} objects read ({} bytes), {} written ({} bytes)",
                why == TaskRunner::Exit::kCleared ? "mapping closed" : "session done", st.tasks_ok, st.tasks_failed,
                st.tasks_dropped, st.bytes_to_host, st.bytes_to_device, st.storage.tasks, st.storage.objects_read,
                st.storage.bytes_read, st.storage.objects_written, st.storage.bytes_written);
      if (why == TaskRunner::Exit::kDeviceLost) {
        KVTD_ERROR("the device context is lost (a sticky CUDA error; see the failed task above): every later "
                   "copy would fail. Exiting with code {} so the service restarts with a new context",
                   kExitDeviceLost);
        endpoint.set_ready(0);
        registry.set_attached(false, 0);
        control_state.detached();
        notify_status("device context lost; exiting for a restart");
        return kExitDeviceLost;
      }
      if (why != TaskRunner::Exit::kCleared) break;
      // Every task before the clear has completed; nothing touches the tensors any more.
      endpoint.set_ready(proto::kReadyHostPool);
      backend->close_tensors();
      owned.reset();  // FastDeploy's worker released it before the clear (the adapter waits for that)
      if (auto clear = runner.clear_task()) {
        finish_clear(endpoint, **pool, *clear);
      } else if (control_state.clear_drops_host_tier.exchange(false)) {
        (*pool)->mark_all_invalid();
        KVTD_INFO("host tier dropped with the clear");
      }
      live = false;
    }
    endpoint.set_ready(0);
    registry.set_attached(false, 0);
    control_state.detached();
    backend->close_tensors();
    owned.reset();
    if (why != TaskRunner::Exit::kStopped) {
      // The session is over for us: nobody will read this pool again (a new session is a new
      // generation with a new pool).
      (*pool)->remove();
    }
    if (why == TaskRunner::Exit::kRingCorrupt)
      KVTD_ERROR("task ring framing is corrupt; detached, waiting for a new session");
    if (why == TaskRunner::Exit::kSessionLost)
      KVTD_WARN("engine closed the session or stopped heartbeating; detached{}",
                stop.load() ? "" : ", waiting for a new session");
  }
  KVTD_INFO("stopped");
  return kExitOk;
}

}  // namespace kvtd::daemon
