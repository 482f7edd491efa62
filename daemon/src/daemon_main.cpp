#include "kvtd/daemon/daemon_main.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "kvtd/daemon/host_pool.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/daemon/task_runner.h"
#include "kvtd/ipc/rank_endpoint.h"

namespace kvtd::daemon {
namespace {

// Maps every tensor of this rank and pairs it with its host-pool region.
Result<AttachedCache, DeviceErrc> attach_cache(ipc::RankEndpoint& ep, DeviceBackend& backend, const HostPool& pool) {
  const auto& g = ep.geometry();
  AttachedCache c;
  c.device_blocks = g.num_device_blocks();
  c.host_blocks = g.num_host_blocks;
  c.num_layers = g.num_layers;
  for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
    if (g.has_tensor(static_cast<proto::TensorKind>(k))) c.block_bytes.push_back(g.block_bytes(static_cast<proto::TensorKind>(k)));
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
      const auto kind = static_cast<proto::TensorKind>(k);
      if (!g.has_tensor(kind)) continue;
      const proto::TensorDesc* d = ep.tensor(l, kind);
      if (!d)
        return make_error(DeviceErrc::kOpenFailed, std::string(proto::tensor_kind_name(kind)) + " tensor of layer " +
                                                       std::to_string(l) + " is not registered");
      auto dev = backend.open_tensor(*d);
      if (!dev.ok()) return std::move(dev).error();
      std::byte* host = pool.region(l, kind);
      const auto bb = g.block_bytes(kind);
      if (host == nullptr) host = *dev;  // no host blocks: every task fails validation anyway
      c.to_host.push_back(kernels::CopyTarget{*dev, host, bb});
      c.to_device.push_back(kernels::CopyTarget{host, *dev, bb});
    }
  return c;
}

class Heartbeat {
 public:
  Heartbeat(ipc::RankEndpoint& ep, std::int64_t period_ns) : ep_(ep), period_ns_(period_ns) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Heartbeat() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_) {
      ep_.heartbeat();
      cv_.wait_for(lk, std::chrono::nanoseconds(period_ns_));
    }
  }
  ipc::RankEndpoint& ep_;
  std::int64_t period_ns_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

int run_daemon(const config::DaemonConfig& cfg, const std::atomic<bool>& stop) {
  std::unique_ptr<DeviceBackend> backend;
  if (cfg.device_backend == config::DeviceBackendKind::kCuda) {
    auto b = make_cuda_backend(cfg.device_id, cfg.scatter_mode);
    if (!b.ok()) {
      KVTD_ERROR("--device-backend cuda: {}", b.error().message);
      return kExitBackend;
    }
    backend = std::move(b).value();
  } else {
    backend = make_host_backend();
  }
  const auto geometry = cfg.geometry();
  auto pool = HostPool::allocate(*backend, geometry);
  if (!pool.ok()) {
    KVTD_ERROR("host pool: {}", pool.error().message);
    return kExitBackend;
  }
  KVTD_INFO("kvtd rank {}/{} backend={} host pool {:.1f} MiB ({} blocks x {} bytes per block, all layers)", cfg.rank,
            cfg.mp_num, backend->name(), static_cast<double>(pool->total_bytes()) / (1 << 20), cfg.num_host_blocks,
            geometry.bytes_per_block_all_layers());

  std::uint64_t last_generation = 0;
  while (!stop.load()) {
    ipc::EndpointOptions eo;
    eo.suffix = cfg.session_suffix;
    eo.rank = cfg.rank;
    eo.expected = geometry;
    eo.attach_timeout_ns = static_cast<std::int64_t>(cfg.attach_timeout_s * 1e9);
    eo.engine_timeout_ns = static_cast<std::int64_t>(cfg.engine_timeout_s * 1e9);
    eo.skip_generation = last_generation;
    eo.stop = &stop;
    eo.on_waiting = [](const std::string& what) { KVTD_INFO("{}", what); };
    eo.on_poll = [] { notify_watchdog(); };
    notify_status("waiting for session");
    KVTD_INFO("waiting for session suffix '{}'", cfg.session_suffix);
    auto ep = ipc::RankEndpoint::attach(eo);
    if (!ep.ok()) {
      const auto code = ep.error().code;
      if (code == ipc::IpcErrc::kClosed) break;  // stop requested while waiting
      KVTD_ERROR("cannot attach: {}", ep.error().message);
      if (code == ipc::IpcErrc::kTimeout) return kExitAttachTimeout;
      return kExitSessionRefused;
    }
    auto& endpoint = **ep;
    last_generation = endpoint.generation();
    auto cache = attach_cache(endpoint, *backend, *pool);
    if (!cache.ok()) {
      KVTD_ERROR("cannot map the cache tensors: {}", cache.error().message);
      backend->close_tensors();
      return kExitBackend;
    }
    auto events = backend->export_layer_events(geometry.num_layers);
    if (!events.ok()) {
      KVTD_ERROR("cannot create the per-layer events: {}", events.error().message);
      backend->close_tensors();
      return kExitBackend;
    }
    endpoint.publish_layer_events(*events);
    TaskRunner runner(endpoint, *backend, std::move(cache).value());
    Heartbeat heartbeat(endpoint, static_cast<std::int64_t>(cfg.heartbeat_period_s * 1e9));
    endpoint.set_ready(proto::kReadyCacheAttached | proto::kReadyHostPool);
    KVTD_INFO("attached to session generation {:016x} as epoch {}; serving", endpoint.generation(), endpoint.epoch());
    notify_ready();
    const auto why = runner.run(stop);
    const auto st = runner.stats();
    KVTD_INFO("session done: {} tasks ok, {} failed, {} bytes to host, {} bytes to device", st.tasks_ok,
              st.tasks_failed, st.bytes_to_host, st.bytes_to_device);
    endpoint.set_ready(0);
    backend->close_tensors();
    if (why == TaskRunner::Exit::kRingCorrupt) KVTD_ERROR("task ring framing is corrupt; detaching");
    if (why == TaskRunner::Exit::kSessionLost)
      KVTD_WARN("engine closed the session or stopped heartbeating; detached{}",
                stop.load() ? "" : ", waiting for a new session");
  }
  KVTD_INFO("stopped");
  return kExitOk;
}

}  // namespace kvtd::daemon
