// work.h (daemon-internal) - one decoded task on its way through the dispatcher, a lane or the
// storage executor.
#pragma once

#include <cstdint>
#include <vector>

#include "kvtd/daemon/storage_executor.h"
#include "kvtd/kernels/copy_plan.h"
#include "kvtd/proto/task.h"

namespace kvtd::daemon {

struct Work {
  proto::TaskRecordHeader header{};
  std::uint32_t epoch = 0;               // the grant under which the record was read
  kernels::CopyPlan plan;                // swaps
  std::vector<std::int32_t> host_ids;    // the blocks it touches, for the block tracker
  std::vector<std::int32_t> device_ids;
  bool storage = false;
  StorageWork storage_work;              // when `storage`
};

}  // namespace kvtd::daemon
