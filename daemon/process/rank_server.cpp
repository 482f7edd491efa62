#include "rank_server.h"

#include <fmt/format.h>
#include <thread>


#include "kvtd/daemon/exit_codes.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/proto/names.h"
#include "cache_mapping.h"
#include "kvtd/daemon/cleared_cache.h"
#include "kvtd/daemon/completion_sink.h"

namespace kvtd::daemon {

using endpoint::RankEndpoint;

int RankServer::run() {
  const int code = serve_sessions();
  // Kept pools are for this daemon to hand on; nobody can take them over once it is gone.
  drop_kept_pools();
  return code;
}

int RankServer::serve_sessions() {
  std::uint64_t last_generation = 0;
  while (!stop_.load()) {
    endpoint::EndpointOptions eo;
    eo.suffix = cfg_.session_suffix;
    eo.rank = cfg_.rank;
    eo.expected = s_.geometry;
    eo.expected_groups = s_.groups;
    eo.expected_identity = cfg_.kv_identity;
    eo.expected_layout = cfg_.kv_layout();
    eo.attach_timeout_ns = cfg_.attach_timeout_ns();
    eo.engine_timeout_ns = cfg_.engine_timeout_ns();
    eo.skip_generation = last_generation;
    eo.stop = &stop_;
    eo.on_waiting = [](const std::string& what) { KVTD_INFO("{}", what); };
    eo.on_poll = [] { notify_watchdog(); };
    notify_status("waiting for session");
    KVTD_INFO("waiting for session suffix '{}'", cfg_.session_suffix);
    auto ep = RankEndpoint::attach(eo);
    if (!ep.ok()) {
      const auto code = ep.error().code;
      if (code == ipc::IpcErrc::kClosed) break;  // stop requested while waiting
      KVTD_ERROR("cannot attach: {}", ep.error().message);
      if (code == ipc::IpcErrc::kTimeout) return kExitAttachTimeout;
      if (code == ipc::IpcErrc::kCorrupt) return kExitSessionCorrupt;
      if (code == ipc::IpcErrc::kSystem || code == ipc::IpcErrc::kNoSpace) return kExitBackend;
      return kExitSessionRefused;
    }
    last_generation = (*ep)->generation();
    if (auto code = serve_session(**ep)) return *code;
  }
  KVTD_INFO("stopped");
  return kExitOk;
}

std::optional<int> RankServer::serve_session(RankEndpoint& ep) {
  // An operator's clear or restore asked of the previous session is not this one's.
  s_.control_state.clear_requested.store(false);
  s_.control_state.restore_requested.store(false);
  // Heartbeat from the grant on: mapping (or creating) the host pool and opening the tensors can
  // take seconds for large caches, and a granted rank that is silent that long is fenced.
  Heartbeat heartbeat(ep, cfg_.heartbeat_period_ns());
  const std::int64_t granted_ns = ipc::monotonic_now_ns();
  notify_status("attached to session " + cfg_.session_suffix + "; mapping the cache and the host pool");
  auto pools = open_pools(ep);
  if (!pools.ok()) return pools.error().code;
  Session s{ep, *pools, heartbeat, std::nullopt, nullptr};
  s.granted_ns = granted_ns;
  for (std::size_t g = 0; g < s.pools.size(); ++g)
    if (s.pools.at(g)->adopted() != 0) s.pool_ready |= proto::kReadyHostTierTakenOver;
  // One pass per mapping of the engine's cache: a weight update (CLEAR_CACHE ... RESTORE_CACHE, or
  // `kvtd ctl clear|restore`) closes it and later maps the re-registered tensors.
  Step step = ep.tensors_loaded() ? live(s, /*after_restore=*/false) : Step::kCleared;
  while (step == Step::kCleared) {
    step = cleared(s);
    if (step == Step::kLive) step = live(s, /*after_restore=*/true);
  }
  if (step == Step::kExit) return s.exit_code;
  end_session(s);
  return std::nullopt;
}

Result<HostPools, int> RankServer::open_pools(const RankEndpoint& ep) {
  HostPool::PinPlan pin;
  pin.threads = cfg_.host_pool_pin_threads;
  pin.first_bytes = std::uint64_t{cfg_.host_pool_pin_first_mib} << 20;
  pin.on_progress = [&registry = s_.registry](std::uint64_t bytes, double seconds) {
    registry.set_host_pool_pinning(bytes, static_cast<std::uint64_t>(seconds * 1000.0));
  };
  // A dead engine's pools not taken over go first: the new ones may need their room.
  if (!ep.take_over_host_tier()) drop_kept_pools();
  const std::uint64_t take_over = kept_generation_;
  kept_locks_.clear();  // a pool taken over is locked again by its HostPool (another description)
  const bool grouped = proto::is_group_session(s_.groups);
  const std::vector<PoolShape> shapes = PoolShape::of_session(s_.geometry, s_.groups);
  std::vector<std::unique_ptr<HostPool>> out;
  for (std::uint32_t g = 0; g < shapes.size(); ++g) {
    const PoolShape& shape = shapes[g];
    auto pool = HostPool::open(*s_.backend, shape, ep.generation(), cfg_.rank, g, cfg_.host_layout, s_.numa_node, pin,
                               cfg_.host_pool_hugepages ? cfg_.hugetlbfs_dir : std::string(), take_over);
    if (!pool.ok()) {
      KVTD_ERROR("host pool{}: {}", grouped ? fmt::format(" of cache group {}", g) : "", pool.error().message);
      return make_error(kExitBackend, pool.error().message);
    }
    if ((*pool)->adopted() != 0)
      KVTD_INFO("host pool {} taken over from the dead session {:016x} this one follows: {} of {} blocks hold data",
                (*pool)->name(), (*pool)->adopted(), (*pool)->valid_blocks(), shape.num_host_blocks);
    else if ((*pool)->restored())
      KVTD_INFO("host pool {} re-mapped from a previous daemon of this session: {} of {} blocks hold data",
                (*pool)->name(), (*pool)->valid_blocks(), shape.num_host_blocks);
    if (cfg_.host_pool_hugepages)
      KVTD_INFO("host pool in {} kB pages under {}", (*pool)->page_bytes() >> 10, cfg_.hugetlbfs_dir);
    out.push_back(std::move(pool).value());
  }
  drop_kept_pools();  // taken over (renamed away) or not ours to take: gone either way
  return HostPools(std::move(out));
}

void RankServer::drop_kept_pools() {
  if (kept_generation_ == 0) return;
  const std::string dir = cfg_.host_pool_hugepages ? cfg_.hugetlbfs_dir : std::string();
  const std::size_t pools = PoolShape::of_session(s_.geometry, s_.groups).size();
  for (std::uint32_t g = 0; g < pools; ++g)
    ipc::SharedObject::remove(ipc::session_object_name(kept_generation_, proto::host_pool_object(cfg_.rank, g)), dir);
  kept_generation_ = 0;
  kept_locks_.clear();
}

void RankServer::release_pools(Session& s) {
  // A stopping daemon leaves the pools to its successor (a restart within the session re-maps
  // them). Else the session is over for us: nobody reads this pool again (a new session is a new
  // generation with a new pool) - unless its engine died rather than closed the session: its
  // restart may take the pools over, so they are kept (this daemon stays their holder) until the
  // next session takes them or does not.
  if (s.why == TaskRunner::Exit::kStopped) return;
  if (s.why == TaskRunner::Exit::kSessionLost && !s.ep.engine_closed()) {
    drop_kept_pools();
    kept_generation_ = s.ep.generation();
    kept_locks_ = s.pools.release_holder_locks();
    KVTD_INFO("engine gone without closing session {:016x}: keeping its host pool for the engine's restart",
              s.ep.generation());
    return;
  }
  s.pools.remove();
}

RankServer::Step RankServer::cleared(Session& s) {
  s.ep.set_ready(s.pool_ready);
  s_.registry.set_attached(true, s.ep.epoch());
  s_.control_state.attached(s.ep.generation());
  s_.control_state.set_cache(ControlState::Cache::kCleared);
  notify_status("cache cleared for a weight update; waiting for restore");
  KVTD_INFO("cache cleared: holding no mapping of the engine's tensors until restore");
  s.heartbeat.serving();
  notify_ready();
  auto& control = s_.control_state;
  const auto out = serve_cleared(s.ep, s.pools, stop_, &control.restore_requested, [&control] { control.restore_refused(); });
  switch (out.why) {
    case ClearedExit::Why::kStopped: s.why = TaskRunner::Exit::kStopped; return Step::kEnd;
    case ClearedExit::Why::kSessionLost: s.why = TaskRunner::Exit::kSessionLost; return Step::kEnd;
    case ClearedExit::Why::kRingCorrupt: s.why = TaskRunner::Exit::kRingCorrupt; return Step::kEnd;
    case ClearedExit::Why::kRestore: break;
  }
  s.restore_task = out.restore_task;
  auto loaded = s.ep.load_tensors();
  if (!loaded.ok() || !*loaded) {
    fail_restore(s, loaded.ok() ? "the engine's cache state is cleared: it registers its tensors and restores"
                                : "tensor registry: " + loaded.error().message);
    return Step::kCleared;
  }
  return Step::kLive;
}

RankServer::Step RankServer::live(Session& s, bool after_restore) {
  const bool by_names = registered_none(s.ep);
  if (by_names && cfg_.fastdeploy.create_cache_tensor && !s.owned) {
    auto made = make_fastdeploy_cache(cfg_, s.ep, *s_.backend);
    if (!made.ok()) {
      KVTD_ERROR("cannot make the KV cache for FastDeploy's worker (--create_cache_tensor): {}", made.error().message);
      if (!after_restore) {
        s.exit_code = kExitBackend;
        return Step::kExit;
      }
      fail_restore(s, made.error().message);
      return Step::kCleared;
    }
    s.owned = std::move(made).value();
  } else if (by_names && !s.owned && !wait_for_fastdeploy_cache(cfg_, s.ep, stop_)) {
    s.why = stop_.load() ? TaskRunner::Exit::kStopped : TaskRunner::Exit::kSessionLost;
    return Step::kEnd;
  }
  auto cache = map_cache(s);
  if (!cache.ok()) {
    s_.backend->close_tensors();
    if (!after_restore) {  // the first mapping, right after attach
      KVTD_ERROR("cannot map the cache tensors: {}", cache.error().message);
      s.exit_code = kExitBackend;
      return Step::kExit;
    }
    fail_restore(s, cache.error().message);  // stay cleared; the engine clears and restores again
    return Step::kCleared;
  }
  auto events = s_.backend->export_layer_events(s_.geometry.num_layers);
  if (!events.ok()) {
    KVTD_ERROR("cannot create the per-layer events: {}", events.error().message);
    s_.backend->close_tensors();
    s.exit_code = kExitBackend;
    return Step::kExit;
  }
  s.ep.publish_layer_events(*events);
  return serve_mapped(s, std::move(cache).value());
}

Result<AttachedCache, DeviceErrc> RankServer::map_cache(Session& s) {
  TensorSource source(s.ep, *s_.backend, cfg_.device_id, registered_none(s.ep), s.owned.get());
  auto cache = attach_cache(s_.geometry, s_.groups, source, s.pools);
  if (!cache.ok()) return cache;
  cache->storage.store = s_.store.get();
  cache->storage.kv_events = s_.kv_events.get();
  cache->storage.metrics = &s_.registry;
  cache->storage.store_name = s_.store_name;
  cache->storage.config = cfg_.storage;
  cache->storage.slicing = s_.slicing;
  cache->storage.object_bytes = s_.geometry.bytes_per_block_all_layers() / s_.slicing.parts;
  if (!cache->storage.groups.empty()) {  // staging slots hold the largest group's object
    cache->storage.object_bytes = 0;
    for (std::uint32_t g = 0; g < cache->storage.groups.size(); ++g) {
      GroupStorage& stored = cache->storage.groups[g];
      stored.store = s_.store ? s_.store_of_group(g) : nullptr;
      cache->storage.object_bytes = std::max(cache->storage.object_bytes, stored.object_bytes);
    }
  }
  cache->storage.config.io_threads =
      storage_io_threads(cfg_.storage, cache->storage.staged_bytes(), std::thread::hardware_concurrency());
  cache->storage.numa_node = s_.numa_node;
  cache->numa_node = s_.numa_node;
  cache->metrics = &s_.registry;
  cache->summary_period_ns = static_cast<std::int64_t>(cfg_.log_summary_period_s * 1e9);
  cache->engine_event_timeout_ns = static_cast<std::int64_t>(cfg_.engine_event_timeout_s * 1e9);
  cache->verify_swaps = cfg_.verify_swaps;
  cache->granted_ns = s.granted_ns;
  s_.registry.set_host_pool_bytes(s.pools.total_bytes());
  if (proto::is_group_session(s_.groups)) {
    std::vector<metrics::MetricsRegistry::GroupFigures> figures;
    for (std::uint32_t g = 0; g < s_.groups.num_groups; ++g)
      figures.push_back({proto::group_kind_name(s_.groups.groups[g].group_kind()), s.pools.at(g)->total_bytes()});
    s_.registry.set_cache_groups(std::move(figures));
  }
  return cache;
}

RankServer::Step RankServer::serve_mapped(Session& s, AttachedCache cache) {
  TaskRunner runner(s.ep, *s_.backend, std::move(cache));
  s.ep.set_ready(proto::kReadyCacheAttached | s.pool_ready);
  if (s.restore_task) {
    KVTD_INFO("cache restored (task {}): the re-registered tensors are mapped", s.restore_task->task_id);
    CompletionSink(s.ep, nullptr).write(*s.restore_task, proto::Outcome::done("tensors re-opened"),
                                        ipc::monotonic_now_ns());
    s.restore_task.reset();
  }
  KVTD_INFO("attached to session generation {:016x} as epoch {}; serving", s.ep.generation(), s.ep.epoch());
  notify_status("serving session " + cfg_.session_suffix);
  notify_ready();
  s.heartbeat.serving();
  s_.registry.set_attached(true, s.ep.epoch());
  s_.control_state.attached(s.ep.generation());
  s_.control_state.set_cache(ControlState::Cache::kLive);  // a clear accepted from here on is kept
  s.why = runner.run(stop_, &s_.control_state.clear_requested);
  const auto st = runner.stats();
  KVTD_INFO("{}: {} tasks ok, {} failed, {} dropped (revoked epoch), {} bytes to host, {} bytes to device; "
            "storage: {} tasks, {} objects read ({} bytes), {} written ({} bytes), {} backups skipped",
            s.why == TaskRunner::Exit::kCleared ? "mapping closed" : "session done", st.tasks_ok, st.tasks_failed,
            st.tasks_dropped, st.bytes_to_host, st.bytes_to_device, st.storage.tasks, st.storage.objects_read,
            st.storage.bytes_read, st.storage.objects_written, st.storage.bytes_written, st.storage.backups_skipped);
  if (s.why == TaskRunner::Exit::kDeviceLost) {
    KVTD_ERROR("the device context is lost (a sticky CUDA error; see the failed task above): every later "
               "copy would fail. Exiting with code {} so the service restarts with a new context",
               kExitDeviceLost);
    s.ep.set_ready(0);
    s_.registry.set_attached(false, 0);
    s_.control_state.detached();
    notify_status("device context lost; exiting for a restart");
    s.exit_code = kExitDeviceLost;
    return Step::kExit;
  }
  if (s.why != TaskRunner::Exit::kCleared) return Step::kEnd;
  close_for_clear(s, runner);
  return Step::kCleared;
}

void RankServer::close_for_clear(Session& s, const TaskRunner& runner) {
  // Every task before the clear has completed; nothing touches the tensors any more.
  s.ep.set_ready(s.pool_ready);
  s_.backend->close_tensors();
  s.owned.reset();  // FastDeploy's worker released it before the clear (the adapter waits for that)
  if (auto clear = runner.clear_task()) {
    finish_clear(s.ep, s.pools, *clear);
  } else if (s_.control_state.clear_drops_host_tier.exchange(false)) {
    s.pools.mark_all_invalid();
    KVTD_INFO("host tier dropped with the clear");
  }
}

void RankServer::fail_restore(Session& s, const std::string& message) {
  KVTD_ERROR("cannot restore the cache: {}", message);
  if (!s.restore_task) return;
  CompletionSink(s.ep, nullptr).write(*s.restore_task, proto::Outcome::failed(proto::TaskStatus::kDeviceError, message),
                                      ipc::monotonic_now_ns());
  s.restore_task.reset();
}

void RankServer::end_session(Session& s) {
  s.ep.set_ready(0);
  s_.registry.set_attached(false, 0);
  s_.control_state.detached();
  s_.backend->close_tensors();
  s.owned.reset();
  release_pools(s);
  if (s.why == TaskRunner::Exit::kRingCorrupt) KVTD_ERROR("task ring framing is corrupt; detached, waiting for a new session");
  if (s.why == TaskRunner::Exit::kSessionLost)
    KVTD_WARN("engine closed the session or stopped heartbeating; detached{}", stop_.load() ? "" : ", waiting for a new session");
}

}  // namespace kvtd::daemon
