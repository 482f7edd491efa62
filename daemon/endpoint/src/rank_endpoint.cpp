#include "kvtd/endpoint/rank_endpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvtd/base/mutex.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/rings.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "kvtd/ipc/segment.h"

namespace kvtd::endpoint {

using namespace kvtd::ipc;  // NOLINT(google-build-using-namespace): the contract this end implements

struct RankEndpoint::Impl {
  EndpointOptions opts;
  std::unique_ptr<SharedObject> mapping;
  detail::SessionView view;           // from the validated header: never re-read
  proto::CacheGeometry geometry{};    // private copy
  std::uint64_t generation = 0;       // private copy
  proto::SessionHeader* h = nullptr;  // for the atomics only
  std::vector<proto::TensorDesc> tensors;  // this rank's, by layer * kTensorKinds + kind
  bool loaded = false;                     // the last load_tensors() found the cache live
  std::vector<std::array<std::uint8_t, proto::kHandleBytes>> events;  // published; again after a re-grant
  std::unique_ptr<TaskRingReader> reader;
  Mutex complete_mu;  // the ring has one producer: the threads that complete tasks take turns
  std::unique_ptr<CompletionRing> completions PT_GUARDED_BY(complete_mu);
  std::atomic<std::uint32_t> epoch{0};  // written by the dispatcher, read by executor threads
  std::uint64_t owner = 0;  // our owner word, once claimed

  proto::RankSlot& slot() { return h->ranks[opts.rank]; }

  // Waits until every live peer has left the agreement slot's previous task (seq minus
  // kAgreementSlots), so writing the slot never overwrites a word a peer has still to read.
  Status<proto::TaskStatus> wait_slot_free(std::uint64_t seq, std::int64_t deadline_ns) {
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
          behind += (behind.empty() ? "" : ",") + std::to_string(r);
      }
      if (behind.empty()) return {};
      if (!granted() || !engine_alive())
        return make_error(TaskStatus::kShuttingDown, "this rank's epoch was revoked or the session ended during the agreement");
      const std::int64_t now = monotonic_now_ns();
      if (deadline_ns != 0 && now >= deadline_ns)
        return make_error(TaskStatus::kDeadlineExceeded,
                          "deadline passed while rank(s) " + behind + " still had to read the agreement of the task " +
                              std::to_string(proto::kAgreementSlots) + " ring records before this one");
      // Short slices: peer liveness is re-checked at least every 5 ms.
      const std::int64_t slice = now + 5'000'000;
      (void)wait_on_word(ctrl->word, seen, deadline_ns != 0 ? std::min(deadline_ns, slice) : slice, &ctrl->waiters, 20'000);
    }
  }

  bool granted() {
    return slot().attached.load(std::memory_order_acquire) != 0 &&
           slot().attached_epoch.load(std::memory_order_acquire) == epoch;
  }

  bool engine_alive() const {
    if (h->state.load(std::memory_order_acquire) != static_cast<std::uint32_t>(proto::SessionState::kReady)) return false;
    return monotonic_now_ns() - h->engine_heartbeat_ns.load(std::memory_order_acquire) <= opts.engine_timeout_ns;
  }

  // Claims the rank for this process: kInUse naming the live owner, else ours.
  Status<IpcErrc> claim() {
    const std::uint64_t me = self_owner_word();
    auto& word = slot().owner;
    for (;;) {
      std::uint64_t cur = word.load(std::memory_order_acquire);
      if (cur == me) break;
      if (cur != 0 && owner_alive(cur))
        return make_error(IpcErrc::kInUse, "rank " + std::to_string(opts.rank) + " is already served by live kvtd pid " +
                                               std::to_string(proto::owner_pid(cur)));
      // The owner is gone (or there is none): take over. A racing newcomer loses the CAS, re-reads
      // us as the live owner and is refused.
      if (word.compare_exchange_strong(cur, me, std::memory_order_acq_rel)) break;
    }
    owner = me;
    return {};
  }

  // Asks the engine for a new epoch and waits for the grant.
  bool request_grant() {
    auto& s = slot();
    std::uint32_t next = s.attach_request.load() + 1;
    if (next == 0) next = 1;
    epoch.store(next, std::memory_order_release);
    s.pid.store(static_cast<std::uint32_t>(getpid()));
    s.heartbeat_ns.store(monotonic_now_ns(), std::memory_order_release);
    s.attach_request.store(next, std::memory_order_release);
    const std::int64_t deadline = monotonic_now_ns() + opts.grant_timeout_ns;
    for (;;) {
      const std::uint32_t seen = h->publish_word.load(std::memory_order_acquire);
      if (granted()) return true;
      if (!engine_alive()) return false;
      if (opts.stop && opts.stop->load()) return false;
      const std::int64_t now = monotonic_now_ns();
      if (now >= deadline) return false;
      s.heartbeat_ns.store(now, std::memory_order_release);
      (void)wait_on_word(h->publish_word, seen, std::min(deadline, now + 20'000'000), &h->consumer_waiters, 0);
    }
  }

  bool cache_live() const {
    // Acquire pairs with the engine's release store: the registry it wrote before is visible.
    return h->cache_state.load(std::memory_order_acquire) == static_cast<std::uint32_t>(proto::CacheState::kLive);
  }

  // Copies and checks this rank's tensor descriptors if the cache is live; else forgets them.
  Result<bool, IpcErrc> load_tensors() {
    loaded = false;
    if (!cache_live()) {
      tensors.assign(std::size_t{geometry.num_layers} * proto::kTensorKinds, proto::TensorDesc{});
      return false;
    }
    if (auto st = copy_tensors(); !st.ok()) return std::move(st).error();
    loaded = true;
    return true;
  }

  // Copies and checks this rank's tensor descriptors.
  Status<IpcErrc> copy_tensors() {
    const auto& g = geometry;
    tensors.assign(std::size_t{g.num_layers} * proto::kTensorKinds, proto::TensorDesc{});
    for (std::uint32_t l = 0; l < g.num_layers; ++l)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
        const auto kind = static_cast<proto::TensorKind>(k);
        if (!g.has_tensor(kind)) continue;
        proto::TensorDesc d;
        std::memcpy(&d, &view.registry()[proto::registry_index(g, opts.rank, l, kind)], sizeof d);
        if (!d.valid) continue;  // reported by the caller when it needs the tensor
        const std::string what = std::string(proto::tensor_kind_name(kind)) + " tensor of rank " +
                                 std::to_string(opts.rank) + " layer " + std::to_string(l);
        if (d.rank != opts.rank || d.layer != l || d.kind != k)
          return make_error(IpcErrc::kCorrupt, "registry entry of the " + what + " names rank " + std::to_string(d.rank) +
                                                   " layer " + std::to_string(d.layer) + " kind " + std::to_string(d.kind));
        std::uint64_t need = 0, end = 0;
        (void)proto::checked_mul(g.block_bytes(kind), static_cast<std::uint64_t>(g.device_blocks(l)), &need);
        if (d.bytes < need || !proto::checked_add(d.offset, d.bytes, &end))
          return make_error(IpcErrc::kCorrupt, "registry entry of the " + what + " has " + std::to_string(d.bytes) +
                                                   " bytes at offset " + std::to_string(d.offset) + "; the geometry needs " +
                                                   std::to_string(need));
        d.valid = 1;
        tensors[std::size_t{l} * proto::kTensorKinds + k] = d;
      }
    return {};
  }
};

RankEndpoint::RankEndpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RankEndpoint::~RankEndpoint() {
  auto& s = impl_->slot();
  s.ready_flags.store(0, std::memory_order_release);
  // Tell the engine at once that this epoch is gone, so it fails what is still pending for us
  // now instead of after the heartbeat timeout. Our completions were all written before this.
  s.leaving_epoch.store(impl_->epoch.load(), std::memory_order_release);
  // Give up the claim so a successor need not check that we are dead.
  std::uint64_t mine = impl_->owner;
  if (mine != 0) s.owner.compare_exchange_strong(mine, 0, std::memory_order_acq_rel);
}

Result<std::unique_ptr<RankEndpoint>, IpcErrc> RankEndpoint::attach(const EndpointOptions& o) {
  if (!proto::valid_session_suffix(o.suffix))
    return make_error(IpcErrc::kInvalidArgument, "session suffix '" + o.suffix + "' must be 1-64 of [A-Za-z0-9_.-]");
  if (o.rank >= proto::kMaxRanks) return make_error(IpcErrc::kInvalidArgument, "rank out of range");
  const std::string name = detail::session_name(o.suffix);
  const std::int64_t start = monotonic_now_ns();
  std::int64_t last_note = start;
  std::string waiting_for = "session " + name + " to appear";

  for (;;) {
    const std::int64_t now = monotonic_now_ns();
    if (o.stop && o.stop->load()) return make_error(IpcErrc::kClosed, "stopped while waiting for " + waiting_for);
    if (o.attach_timeout_ns > 0 && now - start >= o.attach_timeout_ns)
      return make_error(IpcErrc::kTimeout, "gave up after " + std::to_string((now - start) / 1'000'000) +
                                               " ms waiting for " + waiting_for);
    if (o.on_poll) o.on_poll();
    if (o.on_waiting && now - last_note >= 5'000'000'000) {
      o.on_waiting("waiting for " + waiting_for);
      last_note = now;
    }

    auto opened = SharedObject::open(name);
    if (!opened.ok()) {
      if (opened.error().code != IpcErrc::kNotFound) return std::move(opened).error();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    auto m = std::move(opened).value();
    if (m->owner_uid() != getuid())
      return make_error(IpcErrc::kPermission, "session " + name + " is owned by uid " + std::to_string(m->owner_uid()) +
                                                  ", not by this daemon's uid " + std::to_string(getuid()));
    if ((m->mode() & 077) != 0)
      return make_error(IpcErrc::kPermission, "session " + name + " has mode 0" + std::to_string((m->mode() >> 6) & 7) +
                                                  std::to_string((m->mode() >> 3) & 7) + std::to_string(m->mode() & 7) +
                                                  "; it must not be accessible to group or others");
    auto* h = reinterpret_cast<proto::SessionHeader*>(m->data());
    if (m->size() < sizeof(proto::SessionHeader)) {  // still being sized by the engine
      waiting_for = "session " + name + " to be initialised";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    // Acquire pairs with the engine's release store of the magic: the header fields are complete.
    const std::uint64_t magic = std::atomic_ref<std::uint64_t>(h->magic).load(std::memory_order_acquire);
    if (magic == 0) {
      waiting_for = "session " + name + " to be initialised";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (magic != proto::kSessionMagic)
      return make_error(IpcErrc::kBadMagic, "shared memory object " + name + " is not a kvtd session (bad magic)");
    const detail::HeaderCopy copy = detail::copy_header(*h);
    if (copy.layout_version != proto::kSessionLayoutVersion || copy.header_bytes != sizeof(proto::SessionHeader))
      return make_error(IpcErrc::kBadVersion, "session " + name + " has layout version " +
                                                  std::to_string(copy.layout_version) + ", this daemon speaks " +
                                                  std::to_string(proto::kSessionLayoutVersion));
    const auto state = static_cast<proto::SessionState>(h->state.load(std::memory_order_acquire));
    const bool stale = monotonic_now_ns() - h->engine_heartbeat_ns.load() > o.engine_timeout_ns;
    if (copy.generation == o.skip_generation || state == proto::SessionState::kClosed || stale) {
      waiting_for = "a new session " + name + " (the current one is closed or its engine is gone)";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (state != proto::SessionState::kReady) {
      waiting_for = "session " + name + " to be published";
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    // Published: the layout is final. Copy it once, check the copy against the mapping, and
    // use only the copy from here on.
    const detail::HeaderCopy fixed = detail::copy_header(*h);
    auto layout = detail::validate_header(fixed, m->size());
    if (!layout.ok()) return make_error(layout.error().code, "session " + name + ": " + layout.error().message);
    if (o.rank >= fixed.geometry.num_ranks)
      return make_error(IpcErrc::kGeometryMismatch, "rank: this daemon is rank " + std::to_string(o.rank) +
                                                        " but the session has " +
                                                        std::to_string(fixed.geometry.num_ranks) + " ranks");
    if (auto diff = detail::geometry_mismatch(fixed.geometry, o.expected); !diff.empty())
      return make_error(IpcErrc::kGeometryMismatch, "session " + name + " disagrees on " + diff);

    auto impl = std::make_unique<Impl>();
    impl->opts = o;
    impl->h = h;
    impl->geometry = fixed.geometry;
    impl->generation = fixed.generation;
    impl->view.base = m->data();
    impl->view.layout = *layout;
    impl->view.num_ranks = fixed.geometry.num_ranks;
    impl->view.num_layers = fixed.geometry.num_layers;
    impl->mapping = std::move(m);
    impl->reader = std::make_unique<TaskRingReader>(h, impl->view.ring(), layout->ring_bytes, o.rank);
    impl->completions = std::make_unique<CompletionRing>(impl->view.completion_control(o.rank),
                                                         impl->view.completion_records(o.rank), layout->completion_capacity);
    if (auto st = impl->claim(); !st.ok()) return make_error(st.error().code, "session " + name + ": " + st.error().message);
    if (!impl->request_grant()) {
      // Give the claim back: we are not serving.
      std::uint64_t mine = impl->owner;
      impl->slot().owner.compare_exchange_strong(mine, 0, std::memory_order_acq_rel);
      if (o.stop && o.stop->load()) return make_error(IpcErrc::kClosed, "stopped while waiting for the attach grant");
      if (!impl->engine_alive()) {
        waiting_for = "a new session " + name + " (the engine left during attach)";
        continue;
      }
      return make_error(IpcErrc::kTimeout, "engine did not grant rank " + std::to_string(o.rank) + " attach within " +
                                               std::to_string(o.grant_timeout_ns / 1'000'000) + " ms");
    }
    // The registry is read after the grant: from then on the engine tells this rank of every
    // clear and restore through the ring (see proto::CacheState).
    std::unique_ptr<RankEndpoint> ep(new RankEndpoint(std::move(impl)));
    if (auto st = ep->impl_->load_tensors(); !st.ok())
      return make_error(st.error().code, "session " + name + ": " + st.error().message);
    return ep;
  }
}

Result<bool, IpcErrc> RankEndpoint::load_tensors() { return impl_->load_tensors(); }
bool RankEndpoint::cache_live() const { return impl_->cache_live(); }
bool RankEndpoint::tensors_loaded() const { return impl_->loaded; }

RankEndpoint::Next RankEndpoint::next_task(std::vector<std::byte>& record, std::int64_t deadline_ns) {
  auto* impl = impl_.get();
  auto* h = impl->h;
  for (;;) {
    if (!impl->granted()) {
      if (!impl->engine_alive()) return Next::kLost;
      if (!impl->request_grant()) return Next::kLost;
      // The engine trusts event handles of the granted epoch only: publish ours under the new one.
      if (!impl->events.empty()) publish_layer_events(std::vector(impl->events));
      return Next::kRegranted;
    }
    const std::uint32_t seen = h->publish_word.load(std::memory_order_acquire);
    switch (impl->reader->try_pop(record)) {
      case TaskRingReader::Read::kRecord:
        bump_and_wake(h->space_word, &h->producer_waiters);
        // Checked after the pop: the engine may have revoked us while we read, and then this
        // record is one it already failed for us (and the grant reset our cursor anyway).
        if (!impl->granted()) continue;
        return Next::kTask;
      case TaskRingReader::Read::kCorrupt: return Next::kCorrupt;
      case TaskRingReader::Read::kEmpty: break;
    }
    if (!impl->engine_alive()) return Next::kLost;
    const std::int64_t now = monotonic_now_ns();
    if (now >= deadline_ns) return Next::kTimeout;
    (void)wait_on_word(h->publish_word, seen, deadline_ns, &h->consumer_waiters, 50'000);
  }
}

Status<IpcErrc> RankEndpoint::complete(const proto::CompletionRecord& record) {
  {
    MutexLock g(impl_->complete_mu);
    if (!impl_->completions->try_push(record))
      return make_error(IpcErrc::kRingFull, "completion ring of rank " + std::to_string(impl_->opts.rank) +
                                                " is full: the engine is not draining it");
  }
  bump_and_wake(impl_->h->completion_word, &impl_->h->completion_waiters);
  bump_and_wake(impl_->h->progress_word, &impl_->h->progress_waiters);  // ends wait_layer on failures too
  return {};
}

void RankEndpoint::progress_begin(const proto::TaskRecordHeader& task) {
  auto* slot = impl_->view.progress_slot(impl_->opts.rank, task.seq);
  // task_id 0 first: a reader that sees the counters change sees a task id that is not theirs.
  slot->task_id.store(0, std::memory_order_release);
  slot->layers_enqueued.store(0, std::memory_order_release);
  slot->layers_done.store(0, std::memory_order_release);
  slot->task_id.store(task.task_id, std::memory_order_release);
}

void RankEndpoint::progress_update(const proto::TaskRecordHeader& task, std::uint32_t layers_enqueued,
                                   std::uint32_t layers_done) {
  auto* slot = impl_->view.progress_slot(impl_->opts.rank, task.seq);
  slot->layers_enqueued.store(layers_enqueued, std::memory_order_release);
  slot->layers_done.store(layers_done, std::memory_order_release);
  bump_and_wake(impl_->h->progress_word, &impl_->h->progress_waiters);
}

void RankEndpoint::publish_layer_events(const std::vector<std::array<std::uint8_t, proto::kHandleBytes>>& handles) {
  const auto n = static_cast<std::uint32_t>(std::min<std::size_t>(handles.size(), impl_->geometry.num_layers));
  impl_->events = handles;
  auto* control = impl_->view.progress_control(impl_->opts.rank);
  // Withdrawn first: a reader that copies while we overwrite sees the count change.
  control->events_published.store(0, std::memory_order_seq_cst);
  for (std::uint32_t l = 0; l < n; ++l) {
    auto* words = reinterpret_cast<std::uint64_t*>(impl_->view.event_handle(impl_->opts.rank, l));
    for (std::size_t w = 0; w < proto::kHandleBytes / 8; ++w) {
      std::uint64_t v = 0;
      std::memcpy(&v, handles[l].data() + 8 * w, 8);
      // Release: an engine whose acquire load reads this word then sees events_published = 0 above
      // (so its re-check fails instead of accepting a half-written handle).
      std::atomic_ref<std::uint64_t>(words[w]).store(v, std::memory_order_release);
    }
  }
  control->events_epoch.store(impl_->epoch.load(), std::memory_order_relaxed);
  // Release publishes the handle words and the epoch above to the engine's acquire.
  control->events_published.store(n, std::memory_order_release);
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
  for (std::uint32_t r = 0; r < n; ++r)
    if (r != me) pending_mask |= 1u << r;
  for (;;) {
    const std::uint32_t seen = ctrl->word.load(std::memory_order_acquire);
    for (std::uint32_t r = 0; r < n; ++r) {
      if (!(pending_mask & (1u << r))) continue;
      const std::uint64_t w = impl->view.agreement_slot(r, seq)->load(std::memory_order_acquire);
      const std::uint32_t tag = proto::agreement_tag(w);
      if (tag == want_tag) {
        const std::uint32_t v = proto::agreement_value(w);
        if ((v & proto::kAgreementAbort) == proto::kAgreementAbort) {
          // Every rank reports the root cause, so the merged status (the lowest failing rank's) is
          // that cause whichever rank hit it (it said agreement_failed when rank 0 was waiting).
          const std::uint32_t code = v & 0xFFFFu;
          const auto why = static_cast<TaskStatus>(code);
          const bool known = code != 0 && code <= static_cast<std::uint32_t>(TaskStatus::kCacheCleared);
          return make_error(known ? why : TaskStatus::kAgreementFailed,
                            "rank " + std::to_string(r) + " failed this task before the ranks agreed (" +
                                proto::task_status_name(why) + ")");
        }
        agreed = std::min(agreed, proto::agreement_value(w));
        pending_mask &= ~(1u << r);
        continue;
      }
      // Newer (modulo 2^32) than ours: the slot was reused before we read it.
      if (static_cast<std::int32_t>(tag - want_tag) > 0)
        return make_error(TaskStatus::kAgreementFailed, "rank " + std::to_string(r) + " reused the agreement slot of this task (more than " +
                                                            std::to_string(proto::kAgreementSlots) + " storage tasks apart)");
      const auto& slot = impl->h->ranks[r];
      if (!slot.attached.load(std::memory_order_acquire) || slot.attached_epoch.load(std::memory_order_acquire) != peer_epoch[r])
        return make_error(TaskStatus::kRankDead, "rank " + std::to_string(r) +
                                                     " was declared dead by the engine while the ranks were agreeing");
    }
    if (pending_mask == 0) return agreed;
    if (!impl->granted() || !impl->engine_alive())
      return make_error(TaskStatus::kShuttingDown, "this rank's epoch was revoked or the session ended during the agreement");
    const std::int64_t now = monotonic_now_ns();
    if (deadline_ns != 0 && now >= deadline_ns) {
      std::string who;
      for (std::uint32_t r = 0; r < n; ++r)
        if (pending_mask & (1u << r)) who += (who.empty() ? "" : ",") + std::to_string(r);
      return make_error(TaskStatus::kDeadlineExceeded, "deadline passed while waiting for rank(s) " + who + " to agree");
    }
    // Short slices: peer liveness is re-checked at least every 5 ms.
    const std::int64_t slice = now + 5'000'000;
    (void)wait_on_word(ctrl->word, seen, deadline_ns != 0 ? std::min(deadline_ns, slice) : slice, &ctrl->waiters, 20'000);
  }
}

bool RankEndpoint::granted() const { return impl_->granted(); }
std::uint64_t RankEndpoint::ring_published() const { return impl_->h->ring_head.load(std::memory_order_acquire); }
std::uint64_t RankEndpoint::ring_read() const { return impl_->slot().consumed.load(std::memory_order_relaxed); }
void RankEndpoint::heartbeat() { impl_->slot().heartbeat_ns.store(monotonic_now_ns(), std::memory_order_release); }
void RankEndpoint::set_ready(std::uint32_t flags) { impl_->slot().ready_flags.store(flags, std::memory_order_release); }
bool RankEndpoint::engine_alive() const { return impl_->engine_alive(); }
const proto::CacheGeometry& RankEndpoint::geometry() const { return impl_->geometry; }
std::uint32_t RankEndpoint::rank() const { return impl_->opts.rank; }
std::uint64_t RankEndpoint::generation() const { return impl_->generation; }
std::uint32_t RankEndpoint::epoch() const { return impl_->epoch.load(std::memory_order_acquire); }

const proto::TensorDesc* RankEndpoint::tensor(std::uint32_t layer, proto::TensorKind kind) const {
  const auto& g = impl_->geometry;
  if (layer >= g.num_layers || !g.has_tensor(kind)) return nullptr;
  const auto* d = &impl_->tensors[std::size_t{layer} * proto::kTensorKinds + static_cast<std::uint32_t>(kind)];
  return d->valid ? d : nullptr;
}

}  // namespace kvtd::endpoint
