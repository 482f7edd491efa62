#include "kvtd/base/mutex.h"
#include "kvtd/daemon/control_handler.h"
#include "kvtd/daemon/storage_executor.h"
#include "storage_gc.h"

#include "kvtd/base/version.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"

namespace kvtd::daemon {
namespace {

using json = nlohmann::json;

std::int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// How long `clear` / `restore` wait for the serving loop before answering: tasks in flight
// finish first. The reply then says where it got to; `kvtd ctl status` shows the rest.
constexpr std::int64_t kCacheWaitMs = 20'000;

// The store and the namespace this rank's objects go to: deployments that share stored KV across
// TP sizes show the same layout fingerprint.
json storage_status(const config::DaemonConfig& cfg, const std::string& store_name) {
  json j{{"backend", store_name.empty() ? "none" : store_name}};
  proto::ObjectSlicing s;
  if (store_name.empty() || !cfg.object_slicing(&s).empty()) return j;
  char fp[17];
  if (proto::is_group_session(cfg.cache_groups)) {  // a namespace per group: cache_groups[].layout_fingerprint
    j["objects"] = "by_cache_group";
    return j;
  }
  std::snprintf(fp, sizeof fp, "%016llx", static_cast<unsigned long long>(layout_fingerprint(cfg.geometry(), s, cfg.kv_identity)));
  j["layout_fingerprint"] = fp;
  j["objects"] = s.replicated ? "replicated" : s.by_head ? "by_head" : "by_rank";
  j["objects_per_block"] = s.parts;
  if (s.by_head) j["heads_per_object"] = s.heads_per_part;
  j["writes"] = s.writer;
  return j;
}

// A daemon of cache groups (--cache-group): each group's shape, host pool and the bytes swaps
// moved of it; an empty list for a single-shape cache.
json groups_status(const config::DaemonConfig& cfg, const metrics::MetricsRegistry& reg) {
  json out = json::array();
  const auto& gs = cfg.cache_groups;
  const auto pools = reg.cache_groups();
  const proto::GroupSizes sizes = proto::group_sizes(gs);
  for (std::uint32_t g = 0; g < gs.num_groups && g < proto::kMaxGroups; ++g) {
    const auto& c = gs.groups[g];
    json j{{"group", g},
           {"kind", proto::group_kind_name(c.group_kind())},
           {"layers", c.num_layers()},
           {"tensors_per_layer", c.num_tensors},
           {"device_blocks", c.device_blocks},
           {"host_blocks", c.host_blocks},
           {"block_bytes", sizes.block_bytes[g]},
           {"host_pool_bytes", g < pools.size() ? pools[g].host_pool_bytes : 0},
           {"bytes_to_host", reg.group_swap_bytes(g, metrics::Direction::kToHost)},
           {"bytes_to_device", reg.group_swap_bytes(g, metrics::Direction::kToDevice)},
           {"storage_bytes_read", reg.group_storage_bytes(g, metrics::Direction::kStorageRead)},
           {"storage_bytes_written", reg.group_storage_bytes(g, metrics::Direction::kStorageWrite)}};
    if (c.window_tokens != 0) j["window_tokens"] = c.window_tokens;
    // Its stored objects' namespace (a store is shared across TP sizes only by a replicated group).
    char fp[17];
    std::snprintf(fp, sizeof fp, "%016llx", static_cast<unsigned long long>(group_fingerprint(gs, g, cfg.kv_identity)));
    j["layout_fingerprint"] = fp;
    j["stored"] = proto::group_replicated(gs, g) ? "replicated" : "by_rank";
    out.push_back(std::move(j));
  }
  return out;
}

json status_of(const config::DaemonConfig& cfg, const metrics::MetricsRegistry& reg, const std::string& store_name,
               const ControlState& state, const metrics::HealthRoutes& health) {
  json tasks = json::array();
  for (const auto& t : reg.task_counts())
    tasks.push_back({{"kind", proto::task_kind_name(t.kind)}, {"status", proto::task_status_name(t.status)},
                     {"count", t.count}});
  const std::int64_t since = state.attached_since_ms.load();
  json j{
      {"version", kVersion},
      {"pid", static_cast<std::int64_t>(getpid())},
      {"rank", cfg.rank},
      {"data_parallel_id", cfg.data_parallel_id},
      {"session", cfg.session_suffix},
      {"attached", reg.attached()},
      {"epoch", reg.epoch()},
      {"generation", state.generation.load()},
      {"attached_since_unix_ms", since},
      {"attached_for_s", since > 0 ? static_cast<double>(unix_ms() - since) / 1000.0 : 0.0},
      {"draining", state.draining.load()},
      {"cache", cache_state_name(state.cache())},
      {"log_level", spdlog::level::to_string_view(spdlog::get_level()).data()},
      {"tasks", tasks},
      {"bytes",
       {{"to_host", reg.bytes(metrics::Direction::kToHost)},
        {"to_device", reg.bytes(metrics::Direction::kToDevice)},
        {"storage_read", reg.bytes(metrics::Direction::kStorageRead)},
        {"storage_write", reg.bytes(metrics::Direction::kStorageWrite)}}},
      {"queue_depth_bytes", reg.ring_depth()},
      {"host_pool_bytes", reg.host_pool_bytes()},
      {"host_pool_pin_ms", reg.host_pool_pin_ms()},
      {"host_pool_pinned_bytes", reg.host_pool_pinned_bytes()},
      {"host_pool_pin_waits", reg.host_pool_pin_waits()},
      {"storage", storage_status(cfg, store_name)},
      {"cache_groups", groups_status(cfg, reg)},
      {"last_errors", reg.last_errors()},
  };
  // The same facts /healthz and /readyz answer.
  if (health.live) j["health"]["live"] = json::parse(health.live().json);
  if (health.ready) j["health"]["ready"] = json::parse(health.ready().json);
  return j;
}

}  // namespace

const char* cache_state_name(ControlState::Cache c) {
  switch (c) {
    case ControlState::Cache::kDetached: return "detached";
    case ControlState::Cache::kLive: return "live";
    case ControlState::Cache::kCleared: return "cleared";
  }
  return "unknown";
}

void ControlState::attached(std::uint64_t gen) {
  generation.store(gen);
  attached_since_ms.store(unix_ms());
}

void ControlState::detached() {
  attached_since_ms.store(0);
  set_cache(Cache::kDetached);
}

void ControlState::set_cache(Cache c) {
  {
    MutexLock g(mu_);
    cache_ = c;
    if (c != Cache::kLive) clear_requested.store(false);
  }
  cv_.notify_all();
}

bool ControlState::request_clear(bool drop_host_tier) {
  MutexLock g(mu_);
  if (cache_ != Cache::kLive) return false;
  clear_drops_host_tier.store(drop_host_tier);
  clear_requested.store(true);
  return true;
}

ControlState::Cache ControlState::cache() const {
  MutexLock g(mu_);
  return cache_;
}

void ControlState::restore_refused() {
  {
    MutexLock g(mu_);
    refused_ = true;
  }
  cv_.notify_all();
}

ControlState::Wait ControlState::wait_cache(Cache want, std::int64_t timeout_ms) {
  MutexLock lk(mu_);
  const bool done =
      cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&]() REQUIRES(mu_) { return cache_ == want || refused_; });
  const bool refused = refused_ && cache_ != want;
  refused_ = false;
  return !done ? Wait::kTimeout : refused ? Wait::kRefused : Wait::kReached;
}

Result<std::unique_ptr<control::ControlServer>, control::ControlErrc> start_control(
    const config::DaemonConfig& cfg, const metrics::MetricsRegistry& registry, const std::string& store_name,
    ControlState& state, std::atomic<bool>& stop, metrics::HealthRoutes health, std::vector<storage::ObjectStore*> stores,
    events::KvEventPublisher* kv_events) {
  auto dir = control::runtime_dir();
  if (!dir.ok()) return make_error(dir.error().code, "control socket directory: " + dir.error().message);
  const std::string path = control::socket_path(*dir, cfg.session_suffix, cfg.data_parallel_id, cfg.rank);
  auto handler = [&cfg, &registry, store_name, &state, &stop, health, stores,
                  kv_events](const control::Request& r) -> control::Reply {
    control::Reply reply;
    if (r.command == "storage-gc") {
      // Up to max_seconds (an hour): beside the control loop, so a status meanwhile is answered.
      control::Reply later;
      later.later = [&cfg, stores, kv_events, gc = r.gc] { return collect_storage(cfg, stores, kv_events, gc); };
      return later;
    }
    if (r.command == "status") {
      reply.result_json = status_of(cfg, registry, store_name, state, health).dump();
    } else if (r.command == "drain") {
      // The orderly exit of SIGTERM: finish what is in the ring now, take nothing later, exit 0.
      if (!state.draining.exchange(true)) {
        KVTD_INFO("drain requested over the control socket: finishing tasks in flight, then exiting");
        notify_stopping();
      }
      stop.store(true);
      reply.result_json = json{{"draining", true}}.dump();
    } else if (r.command == "log-level") {
      const auto before = spdlog::level::to_string_view(spdlog::get_level());
      spdlog::set_level(spdlog::level::from_str(r.level));
      KVTD_WARN("log level {} -> {} (control socket)", std::string(before.data(), before.size()), r.level);
      reply.result_json = json{{"log_level", r.level}}.dump();
    } else if (r.command == "clear" || r.command == "restore") {
      const bool clear = r.command == "clear";
      const auto want = clear ? ControlState::Cache::kCleared : ControlState::Cache::kLive;
      if (state.cache() == ControlState::Cache::kDetached) {
        reply.ok = false;
        reply.error = "not attached to a session: there is no cache to " + r.command;
        return reply;
      }
      if (state.cache() != want) {
        KVTD_WARN("{} requested over the control socket", clear ? "cache clear" : "cache restore");
        if (clear)
          (void)state.request_clear(r.drop_host_tier);  // not live any more: the wait below says how it ended
        else
          state.restore_requested.store(true);
      }
      const auto waited = state.wait_cache(want, kCacheWaitMs);
      if (waited != ControlState::Wait::kReached) {
        reply.ok = false;
        reply.error = waited == ControlState::Wait::kRefused
                          ? "not restored: the engine has cleared its cache; it restores it (restore_caches) once its "
                            "new tensors are registered"
                      : clear ? fmt::format("still clearing after {} s: tasks in flight have not finished (see "
                                            "`kvtd ctl status`)",
                                            kCacheWaitMs / 1000)
                              : fmt::format("not restored after {} s: the registry could not be re-opened (see the "
                                            "daemon's log)",
                                            kCacheWaitMs / 1000);
        return reply;
      }
      reply.result_json = json{{"cache", cache_state_name(want)}}.dump();
    }
    return reply;
  };
  std::string secret;
  if (!cfg.control_endpoint.empty()) {
    KVTD_ASSIGN_OR_RETURN(secret, control::read_secret_file(cfg.control_secret_file));
  }
  return control::ControlServer::start(path, cfg.control_endpoint, secret, handler);
}

}  // namespace kvtd::daemon
