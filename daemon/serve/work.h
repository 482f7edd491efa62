// work.h (daemon-internal) - one decoded task on its way through the dispatcher, a lane or the
// storage executor.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "kvtd/daemon/storage_executor.h"
#include "kvtd/kernels/copy_plan.h"
#include "kvtd/proto/task.h"
#include "block_counts.h"

namespace kvtd::daemon {

// How often the serving threads (dispatcher, lanes, the cleared-cache loop) waking from an idle
// wait re-check their stop flags and requests.
constexpr std::int64_t kPollSliceNs = 50'000'000;

// The blocks of one cache group a swap moves, in the group's own ids (the task's ids less the
// group's bases).
struct SwapPart {
  std::uint32_t group = 0;
  kernels::CopyPlan plan;
  std::vector<std::int32_t> host_ids;
  std::vector<std::int32_t> device_ids;
};

struct Work {
  proto::TaskRecordHeader header{};
  std::uint32_t epoch = 0;               // the grant under which the record was read
  std::vector<SwapPart> parts;           // swaps: one per cache group it names, in group order
  // A swap's engine event (this rank's, copied out of the record): its copy waits for it.
  std::optional<std::array<std::uint8_t, proto::kEngineEventBytes>> engine_event;
  std::vector<std::int32_t> host_ids;    // the blocks it touches (the task's ids), for the block tracker
  std::vector<std::int32_t> device_ids;
  bool storage = false;
  StorageWork storage_work;              // when `storage`
  // A swap's write-through backup (kTaskFlagBackupPair): the swap's id, kept apart from the header
  // (a cancel while parked clears the after-task); 0 otherwise.
  std::uint64_t backup_of_swap = 0;
};

// What the block tracker sees of a task: its blocks, and on which side it only reads them (a
// swap reads its source side; a STORAGE_WRITE reads its blocks; loads write theirs). A view of
// `w`'s vectors.
inline TrackedTask tracked_task(const Work& w) {
  const auto kind = static_cast<proto::TaskKind>(w.header.kind);
  TrackedTask t{w.header.task_id, w.header.after_task_id, w.host_ids, w.device_ids};
  t.reads_device = kind == proto::TaskKind::kSwapToHost || kind == proto::TaskKind::kStorageWrite;
  t.reads_host = kind == proto::TaskKind::kSwapToDevice || kind == proto::TaskKind::kStorageWrite;
  return t;
}

}  // namespace kvtd::daemon
