// Flags of running a fleet: --kv-events-* (where and how rank 0 publishes KV events,
// kvtd/events/kv_events.h) and --redis-ttl-s (stored objects that expire on their own).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "flag_groups.h"

namespace kvtd::config {

void declare_kv_events_flags(CLI::App& app, DaemonConfig& c) {
  app.add_option("--kv-events-endpoint", c.kv_events.endpoint,
                 "Publish KV events (vLLM's format) on this ZeroMQ PUB endpoint: tcp://*:5557 binds, "
                 "tcp://host:port connects (rank 0 publishes; the others ignore it)");
  app.add_option("--kv-events-format", c.kv_events.format, "map (vLLM's current layout) | array (vLLM <= 0.10)");
  app.add_option("--kv-events-topic", c.kv_events.topic, "Topic frame of every event batch (default empty)");
  app.add_option("--kv-events-medium", c.kv_events.medium,
                 "Medium named in the events (default STORAGE, vLLM's name for a storage tier)");
  app.add_option("--kv-events-locality", c.kv_events.locality,
                 "LOCAL | REMOTE | none: the events' locality (default LOCAL for the file store, REMOTE for "
                 "Redis; none leaves it out)");
}

void declare_lifecycle_flags(CLI::App& app, DaemonConfig& c) {
  app.add_option("--redis-ttl-s", c.storage.redis_ttl_s,
                 "redis: every object expires this many seconds after it was written (0 = never)");
}

Status<ConfigErrc> resolve_lifecycle(const DaemonConfig& c) {
  if (c.storage.redis_ttl_s < 0 || c.storage.redis_ttl_s > 315'360'000)
    return make_error(ConfigErrc::kInvalidValue,
                      fmt::format("--redis-ttl-s: {} must be in [0, 315360000] (10 years)", c.storage.redis_ttl_s));
  if (c.storage.redis_ttl_s > 0 && c.storage.backend != StorageBackendKind::kRedis)
    return make_error(ConfigErrc::kInvalidValue, "--redis-ttl-s: only the Redis store lets objects expire (--storage-backend redis)");
  return {};
}

Status<ConfigErrc> resolve_kv_events(DaemonConfig& c) {
  auto& e = c.kv_events;
  auto bad = [](const std::string& m) { return make_error(ConfigErrc::kInvalidValue, m); };
  if (e.format != "map" && e.format != "array")
    return bad("--kv-events-format: '" + e.format + "' is neither map nor array");
  if (e.endpoint.empty()) return {};
  const bool known_scheme =
      e.endpoint.rfind("tcp://", 0) == 0 || e.endpoint.rfind("ipc://", 0) == 0 || e.endpoint.rfind("inproc://", 0) == 0;
  if (!known_scheme) return bad("--kv-events-endpoint: '" + e.endpoint + "' is not tcp://, ipc:// or inproc://");
  if (c.storage.backend == StorageBackendKind::kNone)
    return bad("--kv-events-endpoint: the events describe the storage tier, and --storage-backend is none");
  if (e.medium.empty()) e.medium = "STORAGE";  // vllm/distributed/kv_events.py: MEDIUM_STORAGE
  if (e.locality.empty()) e.locality = c.storage.backend == StorageBackendKind::kFile ? "LOCAL" : "REMOTE";
  if (e.locality != "LOCAL" && e.locality != "REMOTE" && e.locality != "none")
    return bad("--kv-events-locality: '" + e.locality + "' is not LOCAL, REMOTE or none");
  return {};
}

}  // namespace kvtd::config
