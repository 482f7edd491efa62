// kvtd/daemon/notify.h - systemd readiness and watchdog notifications (no-ops outside systemd).
#pragma once

#include <string>

namespace kvtd::daemon {
void notify_ready();
void notify_status(const std::string& status);
void notify_stopping();
// Sends WATCHDOG=1 when the unit has WatchdogSec set, at most once a second. Called from the
// dispatcher loop and the attach wait, so a wedged dispatcher stops the pings.
void notify_watchdog();
}  // namespace kvtd::daemon
