// kvtd/daemon/daemon_main.h - the daemon's life: attach to the session, map (or create) the
// rank's host pool of that session, serve it, detach when the engine leaves and wait for the
// next one, until `stop`.
//
// Exit codes separate what an operator must fix (2, 3: systemd's RestartPreventExitStatus) from
// what a restart can cure (4, 5, 6).
#pragma once

#include <atomic>

#include "kvtd/config/daemon_config.h"

namespace kvtd::daemon {

inline constexpr int kExitOk = 0;
inline constexpr int kExitBadFlags = 2;
inline constexpr int kExitSessionRefused = 3;  // another uid, mode, magic, version, geometry, or a live daemon owns the rank
inline constexpr int kExitAttachTimeout = 4;
inline constexpr int kExitBackend = 5;         // device backend or host pool failure (e.g. /dev/shm full)
inline constexpr int kExitSessionCorrupt = 6;  // the session's layout or ring framing is broken: transient
inline constexpr int kExitDeviceLost = 7;      // a sticky device error broke the CUDA context: restart
                                               // (the engine recreates it), so systemd restarts us
inline constexpr int kExitCopyStuck = 8;       // a device copy ran past twice --stuck-copy-timeout: a new
                                               // process (new context) is the only way to get the lane back

// Returns the process exit code. `stop` is set by the signal thread, or by `kvtd ctl drain`
// through the control socket (the same orderly exit). Thread-safety: call once.
int run_daemon(const config::DaemonConfig& cfg, std::atomic<bool>& stop);

}  // namespace kvtd::daemon
