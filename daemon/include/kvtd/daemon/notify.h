// kvtd/daemon/notify.h - systemd readiness and watchdog notifications (no-ops outside systemd).
#pragma once

#include <string>

namespace kvtd::daemon {
void notify_ready();
void notify_status(const std::string& status);
void notify_stopping();
void notify_watchdog();  // sends WATCHDOG=1 when the unit has WatchdogSec set
}  // namespace kvtd::daemon
