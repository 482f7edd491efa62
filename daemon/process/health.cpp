#include "health.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>

#include "kvtd/daemon/notify.h"
#include "kvtd/ipc/clock.h"
#include "stuck_copy_watch.h"

namespace kvtd::daemon {

using nlohmann::json;

namespace {

// A key no writer uses: EXISTS of it is one round trip that changes nothing and counts no miss.
const std::string kProbeKey = "kvtd-readyz-probe";

double seconds_since(std::int64_t then_ns) {
  return static_cast<double>(ipc::monotonic_now_ns() - then_ns) / 1e9;
}

}  // namespace

StoreProbe::StoreProbe(storage::ObjectStore& store, std::int64_t period_ms)
    : store_(store), period_ms_(period_ms), thread_([this] { loop(); }) {}

StoreProbe::~StoreProbe() {
  {
    MutexLock l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

StoreProbe::Answer StoreProbe::last() const {
  MutexLock l(mu_);
  return last_;
}

void StoreProbe::loop() {
  for (;;) {
    {
      MutexLock l(mu_);
      last_.asking_since_ns = ipc::monotonic_now_ns();
    }
    auto r = store_.exists(std::span<const std::string>(&kProbeKey, 1));
    Answer a;
    a.checked = true;
    a.reachable = r.ok();
    if (!r.ok()) a.error = r.error().message;
    a.checked_ns = ipc::monotonic_now_ns();
    MutexLock l(mu_);
    last_ = std::move(a);
    if (cv_.wait_for(l, std::chrono::milliseconds(period_ms_), [this]() REQUIRES(mu_) { return stop_; })) return;
  }
}

metrics::HealthAnswer liveness(const HealthSources&) {
  const double idle_s = seconds_since(last_loop_turn_ns());
  const bool ok = idle_s * 1e9 < static_cast<double>(kLoopStaleNs);
  json j{{"live", ok}, {"loop_turned_s_ago", idle_s}, {"stale_after_s", static_cast<double>(kLoopStaleNs) / 1e9}};
  if (!ok) j["reason"] = fmt::format("the serving loop has not turned for {} s", static_cast<int>(idle_s));
  return {ok, j.dump()};
}

metrics::HealthAnswer readiness(const HealthSources& s) {
  json reasons = json::array();
  const bool attached = s.registry.attached();
  const auto cache = s.control.cache();
  const std::uint64_t pool_bytes = s.registry.host_pool_bytes();
  const bool draining = s.control.draining.load();
  if (!attached) reasons.push_back("not attached to an engine's session");
  else if (cache != ControlState::Cache::kLive)
    reasons.push_back(std::string("the engine's tensors are not mapped (cache ") + cache_state_name(cache) + ")");
  if (attached && pool_bytes == 0) reasons.push_back("the host pool is not pinned");
  if (draining) reasons.push_back("draining: finishing work before it stops");
  const std::int64_t copy_ns = s.copies != nullptr ? StuckCopyWatch::running_ns(*s.copies) : 0;
  if (s.stuck_copy_ns > 0 && copy_ns >= s.stuck_copy_ns)
    reasons.push_back(fmt::format("a device copy has run for {} ms without finishing (stuck: the daemon exits 8 at "
                                  "twice --stuck-copy-timeout)",
                                  copy_ns / 1'000'000));
  json store{{"backend", s.store_name.empty() ? "none" : s.store_name}};
  if (s.store != nullptr) {
    const auto a = s.store->last();
    store["reachable"] = a.checked && a.reachable;
    if (a.checked) store["checked_s_ago"] = seconds_since(a.checked_ns);
    if (!a.error.empty()) store["error"] = a.error;
    // A check still waiting for its answer says more than the last one that finished: the store
    // hangs, and a task's call would wait as long.
    const std::int64_t asking_ns = a.asking_since_ns == 0 ? 0 : ipc::monotonic_now_ns() - a.asking_since_ns;
    if (asking_ns >= kStoreProbeStuckNs) {
      store["reachable"] = false;
      store["unanswered_s"] = static_cast<double>(asking_ns) / 1e9;
      reasons.push_back(fmt::format("the store has not answered a check for {} ms", asking_ns / 1'000'000));
    } else if (!a.checked) {
      reasons.push_back("the store has not been checked yet");
    } else if (!a.reachable) {
      reasons.push_back("the store does not answer: " + a.error);
    }
  }
  const bool ok = reasons.empty();
  json j{{"ready", ok},
         {"attached", attached},
         {"epoch", s.registry.epoch()},
         {"cache", cache_state_name(cache)},
         {"host_pool_pinned", pool_bytes > 0},
         {"host_pool_bytes", pool_bytes},
         {"host_pool_pin_ms", s.registry.host_pool_pin_ms()},
         {"host_pool_pinned_bytes", s.registry.host_pool_pinned_bytes()},
         {"draining", draining},
         {"copy_running_s", static_cast<double>(copy_ns) / 1e9},
         {"store", store},
         {"reasons", reasons}};
  return {ok, j.dump()};
}

metrics::HealthRoutes health_routes(const HealthSources& s) {
  return {[s] { return liveness(s); }, [s] { return readiness(s); }};
}

}  // namespace kvtd::daemon
