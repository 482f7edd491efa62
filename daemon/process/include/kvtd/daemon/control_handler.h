// kvtd/daemon/control_handler.h - what the daemon answers on its control socket (status, drain,
// log-level, clear, restore; see kvtd/control/control.h for the transport).
//
// Thread-safety: ControlState is written by the daemon's main thread and read by the control
// thread (atomics; the cache state also under `mu` so the control thread can wait for a change);
// the handler reads the metrics registry (thread-safe) and sets `stop` and the requests.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/config/daemon_config.h"
#include "kvtd/control/control.h"
#include "kvtd/metrics/http_server.h"
#include "kvtd/metrics/registry.h"

namespace kvtd::storage {
class ObjectStore;
}
namespace kvtd::events {
class KvEventPublisher;
}

namespace kvtd::daemon {

struct ControlState {
  std::atomic<std::int64_t> attached_since_ms{0};  // unix time of the current attach; 0 = detached
  std::atomic<std::uint64_t> generation{0};
  std::atomic<bool> draining{false};
  // `kvtd ctl clear|restore`: set by the control thread, taken by the serving loop. The clear
  // request is written only under `mu_` together with the cache state (request_clear,
  // set_cache), so a request accepted while live is kept until the cache leaves the live state;
  // the serving loop reads it lock-free.
  std::atomic<bool> clear_requested{false};
  std::atomic<bool> restore_requested{false};
  std::atomic<bool> clear_drops_host_tier{false};

  enum class Cache { kDetached, kLive, kCleared };
  void attached(std::uint64_t gen);
  void detached();
  // Sets the cache state; leaving the live state ends a pending clear request (satisfied by the
  // clear, or moot once detached).
  void set_cache(Cache c);
  // A clear asked while the cache is live: true when it was recorded (false when not live).
  bool request_clear(bool drop_host_tier);
  Cache cache() const;
  // The serving loop turned down a requested restore (the engine's own clear is the engine's
  // to restore): wakes the waiting control thread.
  void restore_refused();
  // Waits up to `timeout_ms` for the cache state to become `want`.
  enum class Wait { kReached, kRefused, kTimeout };
  Wait wait_cache(Cache want, std::int64_t timeout_ms);

 private:
  mutable Mutex mu_;
  CondVar cv_;
  Cache cache_ GUARDED_BY(mu_) = Cache::kDetached;
  bool refused_ GUARDED_BY(mu_) = false;  // since the last wait_cache
};

// "detached", "live" or "cleared": the cache state as status and the health probes name it.
const char* cache_state_name(ControlState::Cache c);

// Binds the rank's control socket in the runtime directory (and cfg.control_endpoint). The
// registry, state and stop flag must outlive the returned server, and so must what `health`'s
// routes read (status shows their answers under "health").
// `stores` (this rank's namespaces: one, or one per cache group; empty without a store) and
// `kv_events` (may be null) serve `storage gc` and must outlive the server too.
Result<std::unique_ptr<control::ControlServer>, control::ControlErrc> start_control(
    const config::DaemonConfig& cfg, const metrics::MetricsRegistry& registry, const std::string& store_name,
    ControlState& state, std::atomic<bool>& stop, metrics::HealthRoutes health = {},
    std::vector<storage::ObjectStore*> stores = {}, events::KvEventPublisher* kv_events = nullptr);

}  // namespace kvtd::daemon
