#include "kvtd/daemon/completion_sink.h"

#include <fmt/format.h>
#include <string>

#include "kvtd/daemon/log.h"
#include "kvtd/ipc/clock.h"
#include "completion.h"

namespace kvtd::daemon {

using proto::TaskKind;
using proto::TaskStatus;

void CompletionSink::write(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns) {
  const auto rec = completion_record(ep_.rank(), h, o, start_ns);
  if (auto st = ep_.complete(rec); !st.ok()) KVTD_ERROR("lost completion of task {}: {}", h.task_id, st.error().message);
}

void CompletionSink::report(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns,
                            std::uint64_t bytes) {
  const auto kind = static_cast<TaskKind>(h.kind);
  if (o.status != TaskStatus::kOk) {
    std::string failed = fmt::format("task {} ({}) failed: {}: {}", h.task_id, proto::task_kind_name(kind),
                                     proto::task_status_name(o.status), o.message);
    KVTD_WARN("{}", failed);
    if (metrics_) metrics_->note_error(std::move(failed));
  }
  const std::int64_t now = ipc::monotonic_now_ns();
  const std::int64_t wait_ns = queue_wait_ns(h, start_ns);
  const std::int64_t run_ns = now > start_ns ? now - start_ns : 0;
  KVTD_DEBUG("task {} {} {}: {} blocks, {} bytes, queue wait {} us, run {} us", h.task_id, proto::task_kind_name(kind),
             proto::task_status_name(o.status), o.blocks, bytes, wait_ns / 1000, run_ns / 1000);
  if (metrics_) {
    const auto dir = kind == TaskKind::kSwapToHost     ? metrics::Direction::kToHost
                     : kind == TaskKind::kSwapToDevice ? metrics::Direction::kToDevice
                     : kind == TaskKind::kStorageWrite ? metrics::Direction::kStorageWrite
                                                       : metrics::Direction::kStorageRead;
    metrics_->task_done(kind, o.status, dir, bytes, wait_ns, run_ns);
  }
  write(h, o, start_ns);
}

}  // namespace kvtd::daemon
