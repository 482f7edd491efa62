// Storage tasks' cross-rank agreement: each rank's word in the slot of the task's sequence number,
// MIN over the live ranks, abort with a status, a deadline; a slot is written only once every
// live peer left its previous task.
#include "kvtd/endpoint/rank_endpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fmt/format.h>
#include <thread>

#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "endpoint_impl.h"

namespace kvtd::endpoint {

Status<proto::TaskStatus> RankEndpoint::Impl::wait_slot_free(std::uint64_t seq, std::int64_t deadline_ns) {
  using proto::TaskStatus;
  if (seq < proto::kAgreementSlots) return {};
  const std::uint64_t previous = seq - proto::kAgreementSlots;
  auto* ctrl = view.agreement_control();
  for (;;) {
    const std::uint32_t seen = ctrl->word.load(std::memory_order_acquire);
    std::string behind;
    for (std::uint32_t r = 0; r < view.num_ranks; ++r) {
      if (r == opts.rank) continue;
      const auto& peer = h->ranks[r];
      if (!peer.attached.load(std::memory_order_acquire)) continue;  // a rank not live reads nothing
      // Acquire pairs with the peer's release in leave_agreements_below.
      if (peer.agreement_left.load(std::memory_order_acquire) <= previous)
        behind += fmt::format("{}{}", behind.empty() ? "" : ",", r);
    }
    if (behind.empty()) return {};
    if (!granted() || !engine_alive())
      return make_error(TaskStatus::kShuttingDown, "this rank's epoch was revoked or the session ended during the agreement");
    const std::int64_t now = monotonic_now_ns();
    if (deadline_ns != 0 && now >= deadline_ns)
      return make_error(TaskStatus::kDeadlineExceeded,
                        fmt::format("deadline passed while rank(s) {} still had to read the agreement of the task {} "
                                    "ring records before this one", behind, proto::kAgreementSlots));
    // Short slices: peer liveness is re-checked at least every 5 ms.
    const std::int64_t slice = now + 5'000'000;
    (void)wait_on_word(ctrl->word, seen, deadline_ns != 0 ? std::min(deadline_ns, slice) : slice, &ctrl->waiters, 20'000);
  }
}

namespace {

// This rank reads no agreement slot of a task below `seq` any more. Release: a peer that acquires
// the value may overwrite its slot of the older task. Monotonic (a late abort of an old task does
// not move it back).
void leave_agreements_below(std::atomic<std::uint64_t>& left, std::uint64_t seq) {
  std::uint64_t cur = left.load(std::memory_order_relaxed);
  while (cur < seq && !left.compare_exchange_weak(cur, seq, std::memory_order_release, std::memory_order_relaxed)) {
  }
}

}  // namespace

void RankEndpoint::abort_agreement(std::uint64_t seq, proto::TaskStatus why) {
  // The slot is ours to write once the peers left its previous task. An abort may come from the
  // dispatcher, which must not wait on a slow peer for long: it waits at most a second (a peer a
  // whole slot cycle behind is rare) and then writes; a peer that still had to read the older
  // word then fails that task naming the reuse, it never takes a wrong count. It does not move
  // agreement_left: older tasks may still be agreeing on another thread (leave_agreements).
  auto* impl = impl_.get();
  const std::uint32_t value = proto::kAgreementAbort | (static_cast<std::uint32_t>(why) & 0xFFFFu);
  (void)impl->wait_slot_free(seq, monotonic_now_ns() + 1'000'000'000);
  // Release: publishes nothing but the word itself; a waiter acquires it.
  impl->view.agreement_slot(impl->opts.rank, seq)->store(proto::agreement_word(seq, value), std::memory_order_release);
  bump_and_wake(impl->view.agreement_control()->word, &impl->view.agreement_control()->waiters);
}

void RankEndpoint::leave_agreements(std::uint64_t below_seq) {
  leave_agreements_below(impl_->slot().agreement_left, below_seq);
  bump_and_wake(impl_->view.agreement_control()->word, &impl_->view.agreement_control()->waiters);
}

Status<proto::TaskStatus> RankEndpoint::Impl::read_peer(std::uint32_t r, std::uint64_t seq, std::uint32_t want_tag,
                                                        std::uint32_t peer_epoch, std::uint32_t* agreed,
                                                        std::uint32_t* pending_mask) {
  using proto::TaskStatus;
  const std::uint64_t w = view.agreement_slot(r, seq)->load(std::memory_order_acquire);
  const std::uint32_t tag = proto::agreement_tag(w);
  if (tag == want_tag) {
    const std::uint32_t v = proto::agreement_value(w);
    if ((v & proto::kAgreementAbort) == proto::kAgreementAbort) {
      // Every rank reports the root cause, so the merged status (the lowest failing rank's) is
      // that cause whichever rank hit it (it said agreement_failed when rank 0 was waiting).
      const std::uint32_t code = v & 0xFFFFu;
      const auto why = static_cast<TaskStatus>(code);
      const bool known = code != 0 && code <= static_cast<std::uint32_t>(proto::kLastTaskStatus);
      return make_error(known ? why : TaskStatus::kAgreementFailed,
                        fmt::format("rank {} failed this task before the ranks agreed ({})", r,
                                    proto::task_status_name(why)));
    }
    *agreed = std::min(*agreed, v);
    *pending_mask &= ~(1u << r);
    return {};
  }
  // Newer (modulo 2^32) than ours: the slot was reused before we read it.
  if (static_cast<std::int32_t>(tag - want_tag) > 0)
    return make_error(TaskStatus::kAgreementFailed,
                      fmt::format("rank {} reused the agreement slot of this task (more than {} storage tasks "
                                  "apart)", r, proto::kAgreementSlots));
  const auto& slot = h->ranks[r];
  if (!slot.attached.load(std::memory_order_acquire) || slot.attached_epoch.load(std::memory_order_acquire) != peer_epoch)
    return make_error(TaskStatus::kRankDead,
                      fmt::format("rank {} was declared dead by the engine while the ranks were agreeing", r));
  return {};  // not there yet
}

Result<std::uint32_t, proto::TaskStatus> RankEndpoint::agree(std::uint64_t seq, std::uint32_t count,
                                                             std::int64_t deadline_ns) {
  using proto::TaskStatus;
  auto* impl = impl_.get();
  auto* ctrl = impl->view.agreement_control();
  const std::uint32_t me = impl->opts.rank;
  const std::uint32_t n = impl->view.num_ranks;
  const std::uint32_t want_tag = proto::agreement_tag(proto::agreement_word(seq, 0));
  // The epochs the engine granted the peers now: a peer re-granted later was declared dead in
  // between, and its new epoch never sees this task.
  std::vector<std::uint32_t> peer_epoch(n);
  for (std::uint32_t r = 0; r < n; ++r) peer_epoch[r] = impl->h->ranks[r].attached_epoch.load(std::memory_order_acquire);
  // Tasks run through here in ring order: every older one is behind us.
  auto& left = impl->slot().agreement_left;
  leave_agreements_below(left, seq);
  if (auto st = impl->wait_slot_free(seq, deadline_ns); !st.ok()) {
    leave_agreements_below(left, seq + 1);
    return std::move(st).error();
  }
  // Release publishes our count to the peers' acquire loads below.
  impl->view.agreement_slot(me, seq)->store(proto::agreement_word(seq, count), std::memory_order_release);
  bump_and_wake(ctrl->word, &ctrl->waiters);
  if (impl->opts.on_agreement_published) impl->opts.on_agreement_published(seq);
  // However the reading below ends, this rank reads this task's slots no more.
  struct Leave {
    std::atomic<std::uint64_t>& left;
    std::uint64_t seq;
    proto::AgreementControl* ctrl;
    ~Leave() {
      leave_agreements_below(left, seq + 1);
      bump_and_wake(ctrl->word, &ctrl->waiters);
    }
  } leave{left, seq, ctrl};
  std::uint32_t agreed = count;
  std::uint32_t pending_mask = 0;
  // A session serving one rank (one engine process per rank) agrees with nobody: each process's
  // session answers for its rank, and the engine reduces across ranks itself.
  for (std::uint32_t r = 0; r < n; ++r)
    if (r != me && (impl->agreeing_ranks & (1u << r))) pending_mask |= 1u << r;
  for (;;) {
    const std::uint32_t seen = ctrl->word.load(std::memory_order_acquire);
    for (std::uint32_t r = 0; r < n; ++r)
      if (pending_mask & (1u << r)) KVTD_TRY(impl->read_peer(r, seq, want_tag, peer_epoch[r], &agreed, &pending_mask));
    if (pending_mask == 0) return agreed;
    if (!impl->granted() || !impl->engine_alive())
      return make_error(TaskStatus::kShuttingDown, "this rank's epoch was revoked or the session ended during the agreement");
    const std::int64_t now = monotonic_now_ns();
    if (deadline_ns != 0 && now >= deadline_ns) {
      std::string who;
      for (std::uint32_t r = 0; r < n; ++r)
        if (pending_mask & (1u << r)) who += fmt::format("{}{}", who.empty() ? "" : ",", r);
      return make_error(TaskStatus::kDeadlineExceeded, "deadline passed while waiting for rank(s) " + who + " to agree");
    }
    // Short slices: peer liveness is re-checked at least every 5 ms.
    const std::int64_t slice = now + 5'000'000;
    (void)wait_on_word(ctrl->word, seen, deadline_ns != 0 ? std::min(deadline_ns, slice) : slice, &ctrl->waiters, 20'000);
  }
}

}  // namespace kvtd::endpoint
