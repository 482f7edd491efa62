// The rank supervisor (the session's service thread): heartbeats, attach grants, liveness verdicts
// and fencing of ranks that went silent or exited.
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

#include "kvtd/ipc/liveness_lock.h"
#include "kvtd/ipc/populate.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/task_codec.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "session_impl.h"

namespace kvtd::engine {

void EngineSession::Impl::start_fence(std::uint32_t r, std::string why, bool replaced) {
  auto& s = h->ranks[r];
  s.attached.store(0, std::memory_order_release);
  roster.start_fence(r, std::move(why), replaced);
  fences_wanted.fetch_add(1, std::memory_order_release);
  bump_and_wake(h->space_word, &h->producer_waiters);  // its ring bytes are no longer reserved
}

FenceResult EngineSession::Impl::fence_across_namespaces(std::uint32_t r, bool replaced) const {
  // A daemon in another pid namespace cannot be signalled from this one (a pidfd of it cannot be
  // had here; its pid names nobody or someone else: SIGKILL would hit a stranger). Its lock on
  // the segment tells whether it exited; if not, it may still write, and the engine must know.
  // Replaced: the lock the byte holds now is its successor's, taken only once it had let go.
  if (replaced) return {FenceOutcome::kFenced, "its successor holds the rank's lock, so it has let go of it (exited)"};
  switch (ipc::lock_holder(name, mapping->inode(), ipc::rank_lock_byte(r))) {
    case ipc::LockHolder::kNone:
      return {FenceOutcome::kFenced, "its daemon has exited (its lock on the session is released)"};
    case ipc::LockHolder::kHeld:
      return {FenceOutcome::kUnfenced,
              "its daemon runs in another pid namespace and still holds its lock on the session (stopped or "
              "hung): it cannot be signalled from here; share the engine's pid namespace with it "
              "(shareProcessNamespace: true) for fencing"};
    case ipc::LockHolder::kUnknown: break;
  }
  return {FenceOutcome::kUnfenced, "its daemon runs in another pid namespace and its lock cannot be read"};
}

void EngineSession::Impl::service(bool check_pids) {
  proto::CompletionRecord rec;
  for (auto& ring_r : completions)
    while (ring_r.try_pop(rec)) merge(rec);

  const std::int64_t now = clock->now_ns();
  // A rank is dead after rank_timeout of heartbeat silence that this engine was awake to see.
  const std::int64_t watch_from_ns = roster.watch_from(now, opts.rank_timeout_ns);
  for (std::uint32_t r = 0; r < geo.num_ranks; ++r) {
    auto& s = h->ranks[r];
    if (!serves(r)) continue;  // never granted: its daemon serves another process's session
    if (roster[r].fencing) continue;  // no grant and no new verdict until the fence ends
    const std::uint32_t req = s.attach_request.load(std::memory_order_acquire);
    const bool attached = s.attached.load(std::memory_order_relaxed) != 0;
    if (req != 0 && req != s.attached_epoch.load(std::memory_order_relaxed)) {
      if (attached) {
        // A new epoch while the old one is attached: a restarted daemon. The old process must be
        // gone before its tasks fail and the new one is granted.
        start_fence(r, "rank " + std::to_string(r) + " restarted", /*replaced=*/true);
        continue;
      }
      const std::uint64_t ns = s.pid_namespace.load(std::memory_order_relaxed);
      roster.granted(r, s.owner.load(std::memory_order_acquire), ns != 0 && ns == pid_namespace);
      s.consumed.store(h->ring_head.load(std::memory_order_relaxed), std::memory_order_relaxed);
      // The new epoch reads no task before the head, so it reads no agreement slot of one.
      s.agreement_left.store(h->next_seq.load(std::memory_order_relaxed), std::memory_order_relaxed);
      s.attached_epoch.store(req, std::memory_order_release);
      s.attached.store(1, std::memory_order_release);
      bump_and_wake(h->publish_word, &h->consumer_waiters);  // the daemon waits for its grant
      continue;
    }
    if (!attached) continue;
    const std::int64_t age = now - std::max(s.heartbeat_ns.load(std::memory_order_acquire), watch_from_ns);
    if (s.leaving_epoch.load(std::memory_order_acquire) == s.attached_epoch.load(std::memory_order_relaxed)) {
      // An orderly exit: the daemon wrote every completion it will ever write before saying so.
      s.attached.store(0, std::memory_order_release);
      fail_rank(r, TaskStatus::kRankDead, "rank " + std::to_string(r) + " detached (daemon stopped or left the session)");
      bump_and_wake(h->space_word, &h->producer_waiters);
    } else if (age > opts.rank_timeout_ns) {
      start_fence(r, "rank " + std::to_string(r) + " heartbeat is " + std::to_string(age / 1'000'000) + " ms old");
    } else if (check_pids && roster[r].same_pid_namespace) {
      const auto pid = static_cast<pid_t>(s.pid.load(std::memory_order_relaxed));
      if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH)
        start_fence(r, "rank " + std::to_string(r) + " process " + std::to_string(pid) + " exited");
    } else if (check_pids && ipc::lock_holder(name, mapping->inode(), ipc::rank_lock_byte(r)) == ipc::LockHolder::kNone) {
      // Another pid namespace: its pid means nothing here; its lock on the segment does.
      start_fence(r, "rank " + std::to_string(r) + "'s daemon exited (its lock on the session is released)");
    }
  }
}

void EngineSession::Impl::run_fences() {
  if (fences_wanted.load(std::memory_order_acquire) == 0) return;
  std::vector<RankRoster::FenceJob> jobs;
  {
    MutexLock g(mu);
    fences_wanted.store(0, std::memory_order_relaxed);
    jobs = roster.fence_jobs();
  }
  for (const auto& job : jobs) {
    const FenceResult f = !job.same_pid_namespace ? fence_across_namespaces(job.rank, job.replaced)
                          : opts.fencer           ? opts.fencer(job.owner, opts.fence_timeout_ns)
                                                  : fence_process(job.owner, opts.fence_timeout_ns);
    MutexLock g(mu);
    const bool fenced = f.outcome == FenceOutcome::kFenced;
    const std::string why = roster.fence_ended(job.rank, fenced);
    if (fenced)
      fail_rank(job.rank, TaskStatus::kRankDead, why + "; " + f.detail);
    else
      fail_rank(job.rank, TaskStatus::kRankUnfenced,
                why + "; it could not be stopped (" + f.detail +
                    "), so it may still write this task's destination blocks: keep them out of use");
    bump_and_wake(h->publish_word, &h->consumer_waiters);  // a waiting successor may be granted now
  }
}

void EngineSession::Impl::service_loop() {
  MutexLock lk(stop_mu);
  while (!stopping) {
    lk.unlock();
    {
      MutexLock g(mu);
      h->engine_heartbeat_ns.store(clock->now_ns(), std::memory_order_release);
      service(true);
    }
    run_fences();
    h->engine_heartbeat_ns.store(clock->now_ns(), std::memory_order_release);
    lk.lock();
    if (stopping) break;
    stop_cv.wait_for(lk, std::chrono::nanoseconds(opts.service_period_ns));
  }
}

}  // namespace kvtd::engine
