// completion.h (daemon-internal) - builds the one completion record a task gets, for the task
// runner and for the cleared-cache loop alike.
#pragma once

#include <algorithm>
#include <cstring>
#include <string_view>

#include "kvtd/ipc/clock.h"
#include "kvtd/proto/outcome.h"
#include "kvtd/proto/task.h"

namespace kvtd::daemon {

// The record of outcome `o` for task `h` on `rank`, ending now; the message is cut to fit.
inline proto::CompletionRecord completion_record(std::uint32_t rank, const proto::TaskRecordHeader& h,
                                                 const proto::Outcome& o, std::int64_t start_ns) {
  proto::CompletionRecord rec{};
  rec.blocks_skipped = o.skipped;
  rec.task_id = h.task_id;
  rec.seq = h.seq;
  rec.status = static_cast<std::int32_t>(o.status);
  rec.rank = rank;
  rec.kind = h.kind;
  rec.layers_done = o.layers;
  rec.blocks_done = o.blocks;
  rec.start_ns = start_ns;
  rec.end_ns = ipc::monotonic_now_ns();
  const std::size_t n = std::min(o.message.size(), sizeof rec.message - 1);
  std::memcpy(rec.message, o.message.data(), n);
  return rec;
}

}  // namespace kvtd::daemon
