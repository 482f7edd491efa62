// kvtd/daemon/daemon_main.h - the daemon's life: allocate the host pool, then attach to the
// session, serve it, detach when the engine leaves and wait for the next one, until `stop`.
#pragma once

#include <atomic>

#include "kvtd/config/daemon_config.h"

namespace kvtd::daemon {

inline constexpr int kExitOk = 0;
inline constexpr int kExitBadFlags = 2;
inline constexpr int kExitSessionRefused = 3;  // wrong owner, magic, version or geometry
inline constexpr int kExitAttachTimeout = 4;
inline constexpr int kExitBackend = 5;         // device backend or host pool failure

// Returns the process exit code. Thread-safety: call once.
int run_daemon(const config::DaemonConfig& cfg, const std::atomic<bool>& stop);

}  // namespace kvtd::daemon
