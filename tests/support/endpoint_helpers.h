// endpoint_helpers.h - an in-process rank for unit tests of the engine side: attach options and
// a completion report, so a test plays the daemon without starting one.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvtd/endpoint/rank_endpoint.h"

namespace kvtd::test {

inline endpoint::EndpointOptions endpoint_options(const std::string& suffix, std::uint32_t rank, proto::CacheGeometry g) {
  endpoint::EndpointOptions o;
  o.suffix = suffix;
  o.rank = rank;
  o.expected = g;
  o.attach_timeout_ns = 2'000'000'000;
  return o;
}

// A completion with this rank, status and block count.
inline void report(endpoint::RankEndpoint& ep, std::uint64_t id, std::uint32_t rank, proto::TaskStatus st,
                   std::uint64_t blocks) {
  proto::CompletionRecord rec{};
  rec.task_id = id;
  rec.rank = rank;
  rec.status = static_cast<std::int32_t>(st);
  rec.blocks_done = blocks;
  std::snprintf(rec.message, sizeof rec.message, "rank %u says %s", rank, proto::task_status_name(st));
  ASSERT_TRUE(ep.complete(rec).ok());
}

// Heartbeats in-process ranks every 100 ms from a thread of its own, as a daemon's serve loop
// does. Without it the engine counts a rank dead once its rank timeout (3 s) passes after the
// attach, revokes the grant, and the rank's later work is dropped without a completion: a test
// that ran longer than that on a loaded machine waited for an answer that never came.
// Not copyable; stop() (or the destructor) before any watched endpoint is destroyed.
class Heartbeats {
 public:
  Heartbeats() = default;
  Heartbeats(const Heartbeats&) = delete;
  Heartbeats& operator=(const Heartbeats&) = delete;
  ~Heartbeats() { stop(); }

  void watch(endpoint::RankEndpoint& ep) {
    {
      std::lock_guard<std::mutex> g(mu_);
      endpoints_.push_back(&ep);
    }
    ep.heartbeat();
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    while (!cv_.wait_for(lk, std::chrono::milliseconds(100), [&] { return stopping_; }))
      for (auto* ep : endpoints_) ep->heartbeat();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<endpoint::RankEndpoint*> endpoints_;  // guarded by mu_
  bool stopping_ = false;                           // guarded by mu_
  std::thread thread_;
};

}  // namespace kvtd::test
