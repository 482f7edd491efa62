// kvtd/daemon/exit_codes.h - the daemon process's exit codes. They separate what an operator must
// fix (2, 3: systemd's RestartPreventExitStatus) from what a restart can cure (4 to 8).
#pragma once

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

}  // namespace kvtd::daemon
