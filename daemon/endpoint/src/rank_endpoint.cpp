// The daemon's end of a session: attach (claim, grant), the task ring, completions, progress.
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

bool RankEndpoint::Impl::granted() {
  return slot().attached.load(std::memory_order_acquire) != 0 &&
         slot().attached_epoch.load(std::memory_order_acquire) == epoch;
}

bool RankEndpoint::Impl::engine_alive() const {
  if (h->state.load(std::memory_order_acquire) != static_cast<std::uint32_t>(proto::SessionState::kReady)) return false;
  return monotonic_now_ns() - h->engine_heartbeat_ns.load(std::memory_order_acquire) <= opts.engine_timeout_ns;
}

Status<IpcErrc> RankEndpoint::Impl::claim() {
  const std::uint64_t me = self_owner_word();
  auto& word = slot().owner;
  // The rank's lock first: held by another process (a serving daemon, or one stopped) in any pid
  // namespace, the rank is not ours. A pid would name nobody, or someone else, across namespaces.
  auto lock = ipc::LivenessLock::take(mapping->name(), mapping->inode(), ipc::rank_lock_byte(opts.rank));
  if (!lock.ok()) {
    const std::uint64_t cur = word.load(std::memory_order_acquire);
    if (lock.error().code == IpcErrc::kInUse)
      return make_error(IpcErrc::kInUse,
                        fmt::format("rank {} is already served by live kvtd pid {} (a pid of its own pid namespace; "
                                    "it holds the rank's lock on the session)",
                                    opts.rank, proto::owner_pid(cur)));
    return std::move(lock).error();
  }
  rank_lock = std::move(lock).value();
  // Whoever the owner word names has exited (its lock is free): take over. A racing newcomer
  // fails the lock above.
  word.store(me, std::memory_order_release);
  owner = me;
  return {};
}

bool RankEndpoint::Impl::request_grant() {
  auto& s = slot();
  std::uint32_t next = s.attach_request.load() + 1;
  if (next == 0) next = 1;
  epoch.store(next, std::memory_order_release);
  s.pid.store(static_cast<std::uint32_t>(getpid()));
  s.pid_namespace.store(ipc::own_pid_namespace(), std::memory_order_relaxed);
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

namespace {

// A mapped segment this daemon may use: its owner and mode.
Status<IpcErrc> check_access(const SharedObject& m, const std::string& name) {
  if (m.owner_uid() != getuid())
    return make_error(IpcErrc::kPermission, fmt::format("session {} is owned by uid {}, not by this daemon's uid {}",
                                                        name, m.owner_uid(), getuid()));
  if ((m.mode() & 077) != 0)
    return make_error(IpcErrc::kPermission,
                      fmt::format("session {} has mode 0{}{}{}; it must not be accessible to group or others", name,
                                  (m.mode() >> 6) & 7, (m.mode() >> 3) & 7, m.mode() & 7));
  return {};
}

// A published session's header, copied once and checked against the mapping and the daemon's
// flags (only the copy is used from here on).
struct Published {
  detail::HeaderCopy header;
  detail::SessionLayout layout;
};

// Reads the segment's header: the Published copy, or nullopt with `waiting_for` saying what to
// wait for (not initialised, closed, stale, not published yet) and `sleep_ms` how long before
// looking again, or an error that ends attach.
Result<std::optional<Published>, IpcErrc> read_published(const SharedObject& m, const std::string& name,
                                                         const EndpointOptions& o, std::string* waiting_for,
                                                         int* sleep_ms) {
  *sleep_ms = 10;
  auto* h = reinterpret_cast<proto::SessionHeader*>(m.data());
  if (m.size() < sizeof(proto::SessionHeader)) {  // still being sized by the engine
    *waiting_for = "session " + name + " to be initialised";
    return std::optional<Published>{};
  }
  // Acquire pairs with the engine's release store of the magic: the header fields are complete.
  const std::uint64_t magic = std::atomic_ref<std::uint64_t>(h->magic).load(std::memory_order_acquire);
  if (magic == 0) {
    *waiting_for = "session " + name + " to be initialised";
    return std::optional<Published>{};
  }
  if (magic != proto::kSessionMagic)
    return make_error(IpcErrc::kBadMagic, "shared memory object " + name + " is not a kvtd session (bad magic)");
  const detail::HeaderCopy copy = detail::copy_header(*h);
  if (copy.layout_version != proto::kSessionLayoutVersion || copy.header_bytes != sizeof(proto::SessionHeader))
    return make_error(IpcErrc::kBadVersion, fmt::format("session {} has layout version {}, this daemon speaks {}", name,
                                                        copy.layout_version, proto::kSessionLayoutVersion));
  const auto state = static_cast<proto::SessionState>(h->state.load(std::memory_order_acquire));
  const bool stale = monotonic_now_ns() - h->engine_heartbeat_ns.load() > o.engine_timeout_ns;
  if (copy.generation == o.skip_generation || state == proto::SessionState::kClosed || stale) {
    *waiting_for = "a new session " + name + " (the current one is closed or its engine is gone)";
    *sleep_ms = 20;
    return std::optional<Published>{};
  }
  if (state != proto::SessionState::kReady) {
    *waiting_for = "session " + name + " to be published";
    *sleep_ms = 5;
    return std::optional<Published>{};
  }
  // Published: the layout is final. Copy it once, check the copy against the mapping.
  Published p{detail::copy_header(*h), {}};
  auto layout = detail::validate_header(p.header, m.size());
  if (!layout.ok()) return make_error(layout.error().code, "session " + name + ": " + layout.error().message);
  p.layout = *layout;
  if (o.rank >= p.header.geometry.num_ranks)
    return make_error(IpcErrc::kGeometryMismatch,
                      fmt::format("rank: this daemon is rank {} but the session has {} ranks", o.rank,
                                  p.header.geometry.num_ranks));
  if (p.header.served_ranks != 0 && (p.header.served_ranks & (1u << o.rank)) == 0)
    return make_error(IpcErrc::kGeometryMismatch,
                      fmt::format("rank: session {} serves {} only (an engine with one process per rank makes one "
                                  "session per rank) and this daemon is rank {}: give it that rank's session",
                                  name, detail::ranks_text(p.header.served_ranks), o.rank));
  if (auto diff = detail::geometry_mismatch(p.header.geometry, o.expected); !diff.empty())
    return make_error(IpcErrc::kGeometryMismatch, "session " + name + " disagrees on " + diff);
  if (auto diff = detail::groups_mismatch(p.header.groups, o.expected_groups); !diff.empty())
    return make_error(IpcErrc::kGeometryMismatch, "session " + name + " disagrees on " + diff);
  if (auto diff = proto::kv_identity_mismatch(p.header.kv_identity, o.expected_layout, o.expected_identity);
      !diff.empty())
    return make_error(IpcErrc::kGeometryMismatch, "session " + name + " disagrees on " + diff);
  return std::optional<Published>{std::move(p)};
}

}  // namespace

std::unique_ptr<RankEndpoint::Impl> RankEndpoint::Impl::over(const EndpointOptions& o, std::unique_ptr<SharedObject> m,
                                                               const detail::HeaderCopy& header,
                                                               const detail::SessionLayout& layout) {
  auto impl = std::make_unique<Impl>();
  impl->opts = o;
  impl->h = reinterpret_cast<proto::SessionHeader*>(m->data());
  impl->geometry = header.geometry;
  impl->groups = header.groups;
  impl->generation = header.generation;
  impl->engine_pid = header.creator_pid;
  const std::uint64_t own_ns = ipc::own_pid_namespace();
  impl->engine_in_our_pid_namespace = own_ns != 0 && header.engine_pid_namespace == own_ns;
  impl->take_over_host_tier = header.take_over_host_tier != 0;
  impl->agreeing_ranks = proto::ranks_served(header.served_ranks, header.geometry.num_ranks);  // validated
  impl->view.base = m->data();
  impl->view.layout = layout;
  impl->view.num_ranks = header.geometry.num_ranks;
  impl->view.num_layers = header.geometry.num_layers;
  impl->mapping = std::move(m);
  impl->reader = std::make_unique<TaskRingReader>(impl->h, impl->view.ring(), layout.ring_bytes, o.rank);
  MutexLock g(impl->complete_mu);
  impl->completions = std::make_unique<CompletionRing>(impl->view.completion_control(o.rank),
                                                       impl->view.completion_records(o.rank), layout.completion_capacity);
  return impl;
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
      return make_error(IpcErrc::kTimeout,
                        fmt::format("gave up after {} ms waiting for {}", (now - start) / 1'000'000, waiting_for));
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
    KVTD_TRY(check_access(*m, name));
    int sleep_ms = 10;
    KVTD_ASSIGN_OR_RETURN(const auto published, read_published(*m, name, o, &waiting_for, &sleep_ms));
    if (!published.has_value()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
      continue;
    }
    auto impl = Impl::over(o, std::move(m), published->header, published->layout);
    if (auto st = impl->claim(); !st.ok()) {
      // The name no longer held the segment we mapped (replaced by a new session, or moved aside
      // for a moment by a sweep checking it): look again, never a reason to stop.
      if (st.error().code == IpcErrc::kNotFound) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      return make_error(st.error().code, "session " + name + ": " + st.error().message);
    }
    if (!impl->request_grant()) {
      // Give the claim back: we are not serving.
      std::uint64_t mine = impl->owner;
      impl->slot().owner.compare_exchange_strong(mine, 0, std::memory_order_acq_rel);
      if (o.stop && o.stop->load()) return make_error(IpcErrc::kClosed, "stopped while waiting for the attach grant");
      if (!impl->engine_alive()) {
        waiting_for = "a new session " + name + " (the engine left during attach)";
        continue;
      }
      return make_error(IpcErrc::kTimeout, fmt::format("engine did not grant rank {} attach within {} ms", o.rank,
                                                       o.grant_timeout_ns / 1'000'000));
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
    const std::int64_t poll = std::max<std::int64_t>(50'000, impl->poll_until_ns.load(std::memory_order_relaxed) - now);
    (void)wait_on_word(h->publish_word, seen, deadline_ns, &h->consumer_waiters, poll);
  }
}

void RankEndpoint::expect_task_soon(std::int64_t window_ns) {
  impl_->poll_until_ns.store(monotonic_now_ns() + window_ns, std::memory_order_relaxed);
  // Our own dispatcher may be asleep on the engine's word: wake it without changing the word
  // (every rank's sleeping dispatcher re-checks once; the engine's state is untouched).
  wake_sleepers(impl_->h->publish_word, &impl_->h->consumer_waiters);
}

Status<IpcErrc> RankEndpoint::complete(const proto::CompletionRecord& record) {
  {
    MutexLock g(impl_->complete_mu);
    if (!impl_->completions->try_push(record))
      return make_error(IpcErrc::kRingFull,
                        fmt::format("completion ring of rank {} is full: the engine is not draining it",
                                    impl_->opts.rank));
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

bool RankEndpoint::granted() const { return impl_->granted(); }
std::uint64_t RankEndpoint::ring_published() const { return impl_->h->ring_head.load(std::memory_order_acquire); }
std::uint64_t RankEndpoint::ring_read() const { return impl_->slot().consumed.load(std::memory_order_relaxed); }
void RankEndpoint::heartbeat() { impl_->slot().heartbeat_ns.store(monotonic_now_ns(), std::memory_order_release); }
void RankEndpoint::set_ready(std::uint32_t flags) { impl_->slot().ready_flags.store(flags, std::memory_order_release); }
bool RankEndpoint::engine_alive() const { return impl_->engine_alive(); }
const proto::CacheGeometry& RankEndpoint::geometry() const { return impl_->geometry; }
const proto::CacheGroups& RankEndpoint::groups() const { return impl_->groups; }
std::uint32_t RankEndpoint::rank() const { return impl_->opts.rank; }
std::uint64_t RankEndpoint::generation() const { return impl_->generation; }
std::uint32_t RankEndpoint::engine_pid() const { return impl_->engine_pid; }
bool RankEndpoint::mapped_by(std::uint32_t pid) const {
  const auto& m = *impl_->mapping;
  return ipc::process_maps_object(static_cast<int>(pid), m.inode(), m.name());
}
bool RankEndpoint::engine_in_our_pid_namespace() const { return impl_->engine_in_our_pid_namespace; }
bool RankEndpoint::take_over_host_tier() const { return impl_->take_over_host_tier; }
bool RankEndpoint::engine_closed() const {
  return impl_->h->state.load(std::memory_order_acquire) == static_cast<std::uint32_t>(proto::SessionState::kClosed);
}
std::uint32_t RankEndpoint::epoch() const { return impl_->epoch.load(std::memory_order_acquire); }

const proto::TensorDesc* RankEndpoint::tensor(std::uint32_t layer, proto::TensorKind kind) const {
  const auto& g = impl_->geometry;
  if (layer >= g.num_layers || static_cast<std::uint32_t>(kind) >= proto::kTensorKinds) return nullptr;
  const auto* d = &impl_->tensors[std::size_t{layer} * proto::kTensorKinds + static_cast<std::uint32_t>(kind)];
  return d->valid ? d : nullptr;
}

}  // namespace kvtd::endpoint
