// The session's results: each completion record handed to the merger, a dead rank's tasks failed,
// and the wait for one task's result.
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kvtd/ipc/wait.h"
#include "session_impl.h"

namespace kvtd::engine {

void EngineSession::Impl::merge(const proto::CompletionRecord& rec) {
  if (rec.rank >= geo.num_ranks) return;
  std::string msg(rec.message, strnlen(rec.message, sizeof rec.message));
  merger.note_times(rec.task_id, rec.start_ns, rec.end_ns);
  if (merger.report(rec.task_id, rec.rank, static_cast<TaskStatus>(rec.status), rec.blocks_done, std::move(msg),
                    rec.blocks_skipped, clock->now_ns()))
    swaps.finished(rec.task_id, merger.peek(rec.task_id));
}

void EngineSession::Impl::fail_rank(std::uint32_t rank, TaskStatus status, const std::string& why) {
  if (merger.fail_rank(rank, status, why, clock->now_ns()) == 0) return;
  for (const std::uint64_t id : swaps.ids())  // the swaps it ended
    if (!merger.pending(id)) swaps.finished(id, merger.peek(id));
  wake_completion_waiters();
}

Result<TaskResult, IpcErrc> EngineSession::Impl::wait_result(std::uint64_t task_id, std::int64_t timeout_ns) {
  auto* impl = this;
  const std::int64_t deadline = deadline_after(impl->clock->now_ns(), timeout_ns);
  std::optional<CompletionWait> planned;  // the last forecast wait planned for it (none once merged)
  for (;;) {
    if (closing.load(std::memory_order_seq_cst)) return closing_error();
    const std::uint32_t seen = h->completion_word.load(std::memory_order_acquire);
    std::optional<CompletionWait> around;
    {
      MutexLock g(impl->mu);
      around = impl->swaps.wait_for(task_id);
      if (around) planned = around;
      impl->service(false);
      if (auto r = impl->merger.take(task_id)) {
        if (planned) impl->swaps.count_wait(*planned, impl->clock->now_ns());
        return std::move(*r);
      }
      if (!impl->merger.pending(task_id))
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
    // Around a swap's forecast end the waiter polls (a report then costs no wake-up); before it,
    // it sleeps without polling; otherwise a short poll, then sleep.
    std::int64_t until = std::min(deadline, monotonic_now_ns() + impl->opts.service_period_ns);
    std::int64_t poll_ns = ipc::kDefaultSpinNs;
    if (around && now < around->sleep_until_ns) {
      until = std::min(until, around->sleep_until_ns);
      poll_ns = 0;
    } else if (around && now < around->poll_until_ns) {
      poll_ns = around->poll_until_ns - now;
    }
    (void)wait_on_word(h->completion_word, seen, until, &h->completion_waiters, poll_ns);
  }
}

}  // namespace kvtd::engine
