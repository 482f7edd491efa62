#include "kvtd/daemon/notify.h"

#include <atomic>
#include <cstdint>

#include "kvtd/ipc/clock.h"

#ifdef KVTD_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace kvtd::daemon {
namespace {
std::atomic<std::int64_t> g_last_turn_ns{ipc::monotonic_now_ns()};
void record_turn() { g_last_turn_ns.store(ipc::monotonic_now_ns(), std::memory_order_relaxed); }
}  // namespace

std::int64_t last_loop_turn_ns() { return g_last_turn_ns.load(std::memory_order_relaxed); }

#ifdef KVTD_HAVE_SYSTEMD
void notify_ready() { sd_notify(0, "READY=1\nSTATUS=serving"); }
void notify_status(const std::string& status) { sd_notify(0, ("STATUS=" + status).c_str()); }
void notify_stopping() { sd_notify(0, "STOPPING=1"); }
void notify_watchdog() {
  record_turn();
  // Half the unit's WatchdogSec (as sd_watchdog_enabled(3) recommends), at most a second; 0 when
  // systemd expects no pings from this process.
  static const std::int64_t interval_ns = [] {
    std::uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return std::int64_t{0};
    const auto half = static_cast<std::int64_t>(usec / 2) * 1000;
    return half < 1'000'000'000 ? half : std::int64_t{1'000'000'000};
  }();
  if (interval_ns == 0) return;
  // Called from hot loops: one ping per interval, whichever thread gets there first.
  static std::atomic<std::int64_t> last_ns{0};
  const std::int64_t now = ipc::monotonic_now_ns();
  std::int64_t prev = last_ns.load(std::memory_order_relaxed);
  if (now - prev < interval_ns || !last_ns.compare_exchange_strong(prev, now)) return;
  sd_notify(0, "WATCHDOG=1");
}
#else
void notify_ready() {}
void notify_status(const std::string&) {}
void notify_stopping() {}
void notify_watchdog() { record_turn(); }
#endif

}  // namespace kvtd::daemon
