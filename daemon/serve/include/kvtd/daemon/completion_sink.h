// completion_sink.h (daemon-internal) - the one writer of this rank's completion records. Every
// task the rank answers is completed here: by the task runner and the storage executor (through
// the runner), by the cleared-cache loop, and by the serving loop for a restore. Nothing else
// calls RankEndpoint::complete.
//
// Thread-safety: any thread (the endpoint serialises writes to the ring; the metrics registry is
// thread-safe). Borrows the endpoint and the registry; both outlive the sink.
#pragma once

#include <cstdint>
#include <string_view>

#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/metrics/registry.h"
#include "kvtd/proto/outcome.h"
#include "kvtd/proto/task.h"

namespace kvtd::daemon {

class CompletionSink {
 public:
  CompletionSink(endpoint::RankEndpoint& ep, metrics::MetricsRegistry* metrics) : ep_(ep), metrics_(metrics) {}

  // Tells the peers this rank will not agree on storage task `seq` (they fail it with `why`),
  // counted in the metrics' failed agreements.
  void abort_agreement(std::uint64_t seq, proto::TaskStatus why) {
    ep_.abort_agreement(seq, why);
    if (metrics_) metrics_->agreement_failed(why, /*this_rank=*/true);
  }

  // Writes task `h`'s one completion record (ending now; the message cut to fit). A record the
  // ring cannot take is logged as lost: the engine is not draining its completions.
  void write(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns);

  // What a served task reports before its record is written: a failure as a warning and in the
  // metrics' last errors, one debug line, the metrics' task counters (`bytes` moved, the queue
  // wait and run time). Then write().
  void report(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns, std::uint64_t bytes);

  // Engine submit to the start of execution (the same CLOCK_MONOTONIC on both sides), 0 if unknown.
  static std::int64_t queue_wait_ns(const proto::TaskRecordHeader& h, std::int64_t start_ns) {
    return start_ns > h.submit_ns && h.submit_ns > 0 ? start_ns - h.submit_ns : 0;
  }

 private:
  endpoint::RankEndpoint& ep_;
  metrics::MetricsRegistry* metrics_;
};

}  // namespace kvtd::daemon
