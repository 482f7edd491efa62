// kvtd/daemon/control_handler.h - what the daemon answers on its control socket (status, drain,
// log-level; see kvtd/control/control.h for the transport).
//
// Thread-safety: ControlState is written by the daemon's main thread and read by the control
// thread (atomics); the handler reads the metrics registry (thread-safe) and sets `stop`.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "kvtd/config/daemon_config.h"
#include "kvtd/control/control.h"
#include "kvtd/metrics/registry.h"

namespace kvtd::daemon {

struct ControlState {
  std::atomic<std::int64_t> attached_since_ms{0};  // unix time of the current attach; 0 = detached
  std::atomic<std::uint64_t> generation{0};
  std::atomic<bool> draining{false};
  void attached(std::uint64_t gen);
  void detached();
};

// Binds the rank's control socket in the runtime directory (and cfg.control_endpoint). The
// registry, state and stop flag must outlive the returned server.
Result<std::unique_ptr<control::ControlServer>, control::ControlErrc> start_control(
    const config::DaemonConfig& cfg, const metrics::MetricsRegistry& registry, const std::string& store_name,
    ControlState& state, std::atomic<bool>& stop);

}  // namespace kvtd::daemon
