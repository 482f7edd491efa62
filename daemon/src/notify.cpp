#include "kvtd/daemon/notify.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "kvtd/ipc/clock.h"

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
  if (!enabled) return;
  // Called from hot loops: send at most one ping per second.
  static std::atomic<std::int64_t> last_ns{0};
  const std::int64_t now = ipc::monotonic_now_ns();
  std::int64_t prev = last_ns.load(std::memory_order_relaxed);
  if (now - prev < 1'000'000'000 || !last_ns.compare_exchange_strong(prev, now)) return;
  sd_notify(0, "WATCHDOG=1");
}
#else
void notify_ready() {}
void notify_status(const std::string&) {}
void notify_stopping() {}
void notify_watchdog() {}
#endif

}  // namespace kvtd::daemon
