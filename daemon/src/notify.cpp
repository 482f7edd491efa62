#include "kvtd/daemon/notify.h"

#include <cstdlib>

#ifdef KVTD_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace kvtd::daemon {

#ifdef KVTD_HAVE_SYSTEMD
void notify_ready() { sd_notify(0, "READY=1\nSTATUS=serving"); }
void notify_status(const std::string& status) { sd_notify(0, ("STATUS=" + status).c_str()); }
void notify_stopping() { sd_notify(0, "STOPPING=1"); }
void notify_watchdog() {
  static const bool enabled = std::getenv("WATCHDOG_USEC") != nullptr;
  if (enabled) sd_notify(0, "WATCHDOG=1");
}
#else
void notify_ready() {}
void notify_status(const std::string&) {}
void notify_stopping() {}
void notify_watchdog() {}
#endif

}  // namespace kvtd::daemon
