// heartbeat.h (daemon-internal) - the rank's heartbeat thread while attached.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/endpoint/rank_endpoint.h"

namespace kvtd::daemon {

// The rank's heartbeat in the session from the grant on. Until serving() it also pings the
// systemd watchdog: the set-up between grant and READY (mapping tensors, creating and pinning
// the host pool) can outlast WatchdogSec. Once serving, only the dispatcher pings.
class Heartbeat {
 public:
  Heartbeat(endpoint::RankEndpoint& ep, std::int64_t period_ns) : ep_(ep), period_ns_(period_ns) {
    thread_ = std::thread([this] { loop(); });
  }
  void serving() { setting_up_.store(false, std::memory_order_relaxed); }
  ~Heartbeat() {
    {
      MutexLock g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void loop() {
    MutexLock lk(mu_);
    while (!stop_) {
      ep_.heartbeat();
      if (setting_up_.load(std::memory_order_relaxed)) notify_watchdog();
      cv_.wait_for(lk, std::chrono::nanoseconds(period_ns_));
    }
  }
  endpoint::RankEndpoint& ep_;
  std::int64_t period_ns_;
  Mutex mu_;
  CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::atomic<bool> setting_up_{true};
  std::thread thread_;
};

}  // namespace kvtd::daemon
