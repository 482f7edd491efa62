// Completion merging: each rank's report folded into one result per task (the lowest failing
// rank's status, MIN blocks), and the waits for it.
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "kvtd/ipc/populate.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/task_codec.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "session_impl.h"

namespace kvtd::engine {

void EngineSession::Impl::finish_if_complete(std::uint64_t id, Pending& p) {
  if (p.reported != p.expected) return;
  p.result.complete_ns = clock->now_ns();
  // The merged status is the failure of the lowest-numbered failing rank, whatever the order
  // in which reports arrived.
  std::sort(p.result.failures.begin(), p.result.failures.end(),
            [](const RankFailure& a, const RankFailure& b) { return a.rank < b.rank; });
  p.result.status = p.result.failures.empty() ? TaskStatus::kOk : p.result.failures.front().status;
  // A cancelled task keeps how far it got (MIN over ranks); any other failure moved nothing usable.
  if (!p.result.failures.empty() && p.result.status != TaskStatus::kCancelled) p.result.blocks_done = 0;
  done.emplace(id, std::move(p.result));
  pending.erase(id);
  while (done.size() > opts.max_uncollected_results) done.erase(done.begin());  // nobody collects them
}

void EngineSession::Impl::record_report(Pending& p, std::uint32_t rank, TaskStatus status, std::uint64_t blocks,
                   std::string message, std::uint64_t skipped) {
  const std::uint32_t bit = 1u << rank;
  if ((p.expected & bit) == 0 || (p.reported & bit) != 0) return;  // late or duplicate report
  const bool first = p.reported == 0;
  p.reported |= bit;
  if (status != TaskStatus::kOk) {
    p.result.failures.push_back(RankFailure{rank, status, std::move(message)});
    if (status != TaskStatus::kCancelled) blocks = 0;
  }
  if (first || blocks < p.result.blocks_done) p.result.blocks_done = blocks;  // MIN over ranks
  if (first || skipped < p.result.blocks_skipped) p.result.blocks_skipped = skipped;
}

void EngineSession::Impl::merge(const proto::CompletionRecord& rec) {
  auto it = pending.find(rec.task_id);
  if (it == pending.end() || rec.rank >= geo.num_ranks) return;
  std::string msg(rec.message, strnlen(rec.message, sizeof rec.message));
  record_report(it->second, rec.rank, static_cast<TaskStatus>(rec.status), rec.blocks_done,
                std::move(msg), rec.blocks_skipped);
  finish_if_complete(rec.task_id, it->second);
}

void EngineSession::Impl::fail_rank(std::uint32_t rank, TaskStatus status, const std::string& why) {
  std::vector<std::uint64_t> ids;
  for (auto& [id, p] : pending) {
    const std::uint32_t bit = 1u << rank;
    if ((p.expected & bit) && !(p.reported & bit)) ids.push_back(id);
  }
  for (auto id : ids) {
    auto& p = pending[id];
    record_report(p, rank, status, 0, why);
    finish_if_complete(id, p);
  }
  if (!ids.empty()) wake_completion_waiters();
}

Result<TaskResult, IpcErrc> EngineSession::Impl::wait_result(std::uint64_t task_id, std::int64_t timeout_ns) {
  auto* impl = this;
  const std::int64_t deadline = deadline_after(impl->clock->now_ns(), timeout_ns);
  for (;;) {
    if (closing.load(std::memory_order_seq_cst)) return closing_error();
    const std::uint32_t seen = h->completion_word.load(std::memory_order_acquire);
    {
      MutexLock g(impl->mu);
      impl->service(false);
      auto it = impl->done.find(task_id);
      if (it != impl->done.end()) {
        TaskResult r = std::move(it->second);
        impl->done.erase(it);
        return r;
      }
      if (!impl->pending.count(task_id))
        return make_error(IpcErrc::kUnknownTask, "task " + std::to_string(task_id) +
                                                     " is not pending (never submitted, already collected, or dropped "
                                                     "as one of more than " +
                                                     std::to_string(impl->opts.max_uncollected_results) +
                                                     " uncollected results)");
    }
    const std::int64_t now = impl->clock->now_ns();
    if (now >= deadline)
      return make_error(IpcErrc::kTimeout, "task " + std::to_string(task_id) + " not complete after " +
                                               std::to_string(timeout_ns / 1'000'000) + " ms");
    (void)wait_on_word(h->completion_word, seen, std::min(deadline, monotonic_now_ns() + impl->opts.service_period_ns),
                       &h->completion_waiters);
  }
}

}  // namespace kvtd::engine
