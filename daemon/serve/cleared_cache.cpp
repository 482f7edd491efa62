#include "kvtd/daemon/cleared_cache.h"

#include <string>
#include <vector>

#include "kvtd/ipc/clock.h"
#include "kvtd/daemon/completion_sink.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/ipc/task_codec.h"
#include "work.h"

namespace kvtd::daemon {
namespace {

using proto::TaskKind;
using proto::TaskStatus;

void send(endpoint::RankEndpoint& ep, const proto::TaskRecordHeader& h, TaskStatus status, std::uint64_t blocks,
          std::int64_t start_ns, const std::string& message) {
  if (status != TaskStatus::kOk)
    KVTD_WARN("task {} ({}) failed: {}: {}", h.task_id, proto::task_kind_name(static_cast<TaskKind>(h.kind)),
              proto::task_status_name(status), message);
  CompletionSink(ep, nullptr).write(h, proto::Outcome{status, blocks, 0, 0, message}, start_ns);
}

}  // namespace

void finish_clear(endpoint::RankEndpoint& ep, HostPools& pools, const proto::TaskRecordHeader& clear) {
  const std::int64_t start = ipc::monotonic_now_ns();
  const bool drop = (clear.flags & proto::kTaskFlagDropHostTier) != 0;
  if (drop) pools.mark_all_invalid();
  KVTD_INFO("cache cleared (task {}): every mapping of the engine's KV tensors is closed{}", clear.task_id,
            drop ? "; host tier dropped" : "");
  send(ep, clear, TaskStatus::kOk, 0, start, drop ? "mappings closed, host tier dropped" : "mappings closed");
}

ClearedExit serve_cleared(endpoint::RankEndpoint& ep, HostPools& pools, const std::atomic<bool>& stop,
                          std::atomic<bool>* restore_requested, const std::function<void()>& on_restore_refused) {
  std::vector<std::byte> record;
  for (;;) {
    notify_watchdog();
    if (stop.load(std::memory_order_acquire)) return {ClearedExit::Why::kStopped, std::nullopt};
    if (restore_requested != nullptr && restore_requested->exchange(false)) {
      if (ep.cache_live()) return {ClearedExit::Why::kRestore, std::nullopt};
      KVTD_WARN("restore requested over the control socket, but the engine has cleared its cache: it restores it "
                "(restore_caches) once its new tensors are registered");
      if (on_restore_refused) on_restore_refused();
    }
    const auto next = ep.next_task(record, ipc::monotonic_now_ns() + kPollSliceNs);
    switch (next) {
      case endpoint::RankEndpoint::Next::kTimeout: continue;
      case endpoint::RankEndpoint::Next::kLost: return {ClearedExit::Why::kSessionLost, std::nullopt};
      case endpoint::RankEndpoint::Next::kCorrupt: return {ClearedExit::Why::kRingCorrupt, std::nullopt};
      case endpoint::RankEndpoint::Next::kRegranted:
        // Whatever CLEAR/RESTORE the engine failed for us meanwhile, its state word says where
        // it stands now.
        if (ep.cache_live()) return {ClearedExit::Why::kRestore, std::nullopt};
        continue;
      case endpoint::RankEndpoint::Next::kTask: break;
    }
    const std::int64_t now = ipc::monotonic_now_ns();
    proto::TaskRecordHeader h{};
    auto decoded = ipc::decode_task_record(record, &h);
    if (!decoded.ok()) {
      send(ep, h, decoded.error().code, 0, now, decoded.error().message);
      continue;
    }
    const auto kind = static_cast<TaskKind>(h.kind);
    if (kind == TaskKind::kRestoreCache) return {ClearedExit::Why::kRestore, h};
    if (kind == TaskKind::kClearCache) {
      finish_clear(ep, pools, h);
      continue;
    }
    if (kind == TaskKind::kCancel) {  // nothing runs here that it could stop
      send(ep, h, TaskStatus::kOk, 0, now, "");
      continue;
    }
    if (proto::is_storage_kind(kind)) {
      ep.abort_agreement(h.seq, TaskStatus::kCacheCleared);
      ep.leave_agreements(h.seq + 1);  // nothing else on this rank agrees while cleared
    }
    send(ep, h, TaskStatus::kCacheCleared, 0, now,
         "this rank released the KV cache for a weight update; tasks run again after the restore");
  }
}

}  // namespace kvtd::daemon
