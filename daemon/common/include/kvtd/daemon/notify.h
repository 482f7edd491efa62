// kvtd/daemon/notify.h - systemd readiness and watchdog notifications (no-ops outside systemd).
#pragma once

#include <cstdint>
#include <string>

namespace kvtd::daemon {
void notify_ready();
void notify_status(const std::string& status);
void notify_stopping();
// Sends WATCHDOG=1 when the unit has WatchdogSec set, every half of it (at most a second apart
// is enough). Called from the attach wait, from the set-up after a grant (mapping tensors,
// creating and pinning a large host pool can take longer than WatchdogSec) and, once serving,
// only from the dispatcher loop, so a wedged dispatcher stops the pings.
void notify_watchdog();
// Monotonic nanoseconds of the last notify_watchdog call (the process's start before the first,
// with or without systemd): /healthz tells a turning loop from a wedged one by it.
std::int64_t last_loop_turn_ns();
}  // namespace kvtd::daemon
