// cleared_cache.h (daemon-internal) - a rank between CLEAR_CACHE and RESTORE_CACHE: it holds no
// mapping of the engine's KV tensors (the engine may free and re-create them for a weight
// update) and keeps answering the task ring, so nothing submitted meanwhile goes unanswered.
#pragma once

#include <atomic>
#include <functional>
#include <optional>

#include "kvtd/daemon/host_pool.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/proto/task.h"

namespace kvtd::daemon {

// Completes a CLEAR_CACHE once the mappings are closed: drops the host tier first when the task
// asks (its KV belongs to the old weights).
void finish_clear(endpoint::RankEndpoint& ep, HostPools& pools, const proto::TaskRecordHeader& clear);

struct ClearedExit {
  enum class Why { kRestore, kStopped, kSessionLost, kRingCorrupt } why = Why::kStopped;
  std::optional<proto::TaskRecordHeader> restore_task;  // kRestore because of a RESTORE_CACHE record
};

// Serves the ring while cleared: CLEAR_CACHE is answered ok (again), CANCEL ok with nothing to
// stop, every other task fails with cache_cleared (storage tasks also abort their agreement, so
// peer ranks stop waiting). Returns kRestore at a RESTORE_CACHE record, when *restore_requested
// (an operator's `kvtd ctl restore`, reset here) finds the engine's state live, or after a
// re-grant that finds it live; else at stop or when the session ends.
// `on_restore_refused` is called when a requested restore is turned down.
ClearedExit serve_cleared(endpoint::RankEndpoint& ep, HostPools& pools, const std::atomic<bool>& stop,
                          std::atomic<bool>* restore_requested, const std::function<void()>& on_restore_refused);

}  // namespace kvtd::daemon
