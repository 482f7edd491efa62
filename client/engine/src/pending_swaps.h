// pending_swaps.h (client/engine internal) - the swaps in flight that a waiter may wait for by
// forecast: each one's shape (kind, blocks, submit time), how many go each way, the forecast
// learned from those that completed ok, and where waiters took forecast results.
//
// A swap queued behind another of its direction ends later than its own forecast says, so only a
// lone swap of its direction is forecast.
//
// Thread-safety: none (kept under the session's mutex). Copyable and movable.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "completion_forecast.h"
#include "kvtd/engine/engine_session.h"

namespace kvtd::engine {

class PendingSwaps {
 public:
  // Task `task_id` of `kind`, naming `blocks` blocks, was pushed at `submit_ns`; only swaps are
  // recorded.
  void submitted(std::uint64_t task_id, proto::TaskKind kind, std::uint64_t blocks, std::int64_t submit_ns);
  // Task `task_id` ended (completed, failed or dropped) with `result` (nullptr: none kept). The
  // forecast learns from a swap that completed ok. A task that is not a pending swap is ignored.
  void finished(std::uint64_t task_id, const TaskResult* result);
  // The pending swaps' task ids.
  std::vector<std::uint64_t> ids() const;
  // How a waiter should wait for `task_id`: around its forecast end, when it is a lone swap of its
  // direction and a swap of that direction completed ok before.
  std::optional<CompletionWait> wait_for(std::uint64_t task_id) const;
  // A waiter took a result at `taken_ns` while waiting around `around`.
  void count_wait(const CompletionWait& around, std::int64_t taken_ns);
  const ForecastWaits& waits() const { return waits_; }

 private:
  struct Shape {
    proto::TaskKind kind;
    std::uint64_t blocks;
    std::int64_t submit_ns;
  };
  std::unordered_map<std::uint64_t, Shape> shapes_;
  std::uint32_t each_way_[2] = {0, 0};  // pending swaps device->host, host->device
  CompletionForecast forecast_;
  ForecastWaits waits_;
};

}  // namespace kvtd::engine
