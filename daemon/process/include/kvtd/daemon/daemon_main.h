// kvtd/daemon/daemon_main.h - the daemon's life: attach to the session, map (or create) the
// rank's host pool of that session, serve it, detach when the engine leaves and wait for the
// next one, until `stop`.
// Its exit codes are in kvtd/daemon/exit_codes.h.
#pragma once

#include <atomic>

#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/exit_codes.h"

namespace kvtd::daemon {

// Returns the process exit code. `stop` is set by the signal thread, or by `kvtd ctl drain`
// through the control socket (the same orderly exit). Thread-safety: call once.
int run_daemon(const config::DaemonConfig& cfg, std::atomic<bool>& stop);

}  // namespace kvtd::daemon
