// health.h (daemon-internal) - what /healthz, /readyz and `kvtd ctl status`'s "health" say:
// whether the process's loop turns (liveness) and whether the rank can serve (readiness).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/control_handler.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/metrics/http_server.h"
#include "kvtd/metrics/registry.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::daemon {

// Whether the store answers, checked by a thread of its own every `period_ms` (a probe must
// answer from memory: a store that hangs would hang the probe). Ownership: borrows the store,
// which must outlive it. Thread-safe; the destructor stops and joins the thread.
class StoreProbe {
 public:
  StoreProbe(storage::ObjectStore& store, std::int64_t period_ms);
  ~StoreProbe();
  StoreProbe(const StoreProbe&) = delete;
  StoreProbe& operator=(const StoreProbe&) = delete;

  struct Answer {
    bool checked = false;     // false until the first check finished
    bool reachable = false;
    std::string error;        // why not, when not
    std::int64_t checked_ns = 0;  // monotonic time of the check
    std::int64_t asking_since_ns = 0;  // monotonic start of the check in flight (0: none)
  };
  Answer last() const;

 private:
  void loop();
  storage::ObjectStore& store_;
  const std::int64_t period_ms_;
  mutable Mutex mu_;
  CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  Answer last_ GUARDED_BY(mu_);
  std::thread thread_;
};

// How often the store probe asks the store.
inline constexpr std::int64_t kStoreProbePeriodMs = 5000;
// A check unanswered this long means a task's store call would wait as long: not ready.
inline constexpr std::int64_t kStoreProbeStuckNs = 1'000'000'000;

// Liveness fails when the serving loop (or the attach wait) has not turned for this long.
inline constexpr std::int64_t kLoopStaleNs = 10'000'000'000;

// The facts both probes read. All borrowed; each must outlive the routes made from them.
struct HealthSources {
  const metrics::MetricsRegistry& registry;
  const ControlState& control;
  const StoreProbe* store = nullptr;  // null: no storage tier
  std::string store_name;             // "" when none
  const CopyEngine* copies = nullptr;  // the device copies (a stuck one: not ready); null: none
  std::int64_t stuck_copy_ns = 0;      // --stuck-copy-timeout (0: never stuck)
};

metrics::HealthAnswer liveness(const HealthSources& s);
// Ready: attached to a session, the engine's tensors mapped (cache live), the host pool pinned,
// not draining, no device copy running past --stuck-copy-timeout, and the store (if any)
// answering; `reasons` lists every fact that is not so.
metrics::HealthAnswer readiness(const HealthSources& s);
metrics::HealthRoutes health_routes(const HealthSources& s);

}  // namespace kvtd::daemon
