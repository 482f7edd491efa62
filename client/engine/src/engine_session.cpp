// The facade: create, publish, submit, poll and wait, teardown.
#include <signal.h>
#include <sys/stat.h>
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

Error<IpcErrc> EngineSession::Impl::closing_error() const {
  return make_error(IpcErrc::kClosed, "session " + name + " is being closed");
}

EngineSession::EngineSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

void EngineSession::close() {
  // Wake every call that waits in this session (it returns kClosed), then wait until none is
  // inside: only then may the segment be unmapped under them. Each wait of theirs also re-checks
  // `closing` at least every service period, so a wake lost between their check and their sleep
  // only delays them. A forked child's copy closes nothing of its parent's (and its copy of the
  // call count may include calls of threads that do not exist in the child).
  if (getpid() != impl_->creator) return;
  impl_->closing.store(true, std::memory_order_seq_cst);
  // Polled, not notified: a leaving call must not touch the session after its decrement.
  while (impl_->calls.load(std::memory_order_seq_cst) != 0) {
    bump_and_wake(impl_->h->completion_word, nullptr);
    bump_and_wake(impl_->h->space_word, nullptr);
    bump_and_wake(impl_->h->progress_word, nullptr);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

Status<IpcErrc> EngineSession::usable() const {
  const Impl::Gate gate(impl_.get());
  return gate.check();
}

EngineSession::~EngineSession() {
  if (getpid() != impl_->creator) {
    // A forked child's copy: the session is its parent's. Unmap what the child inherited, unlink
    // nothing, write nothing to the segment. The private state is leaked, not destroyed: its
    // mutexes and condition variables may be held by parent threads that do not exist here.
    impl_->mapping->set_unlink_on_destroy(false);
    impl_->mapping.reset();
    for (auto& a : impl_->arenas) a->set_unlink_on_destroy(false);
    impl_->arenas.clear();
    (void)impl_.release();
    return;
  }
  close();
  {
    MutexLock g(impl_->stop_mu);
    impl_->stopping = true;
  }
  impl_->stop_cv.notify_all();
  if (impl_->service_thread.joinable()) impl_->service_thread.join();
  impl_->h->state.store(static_cast<std::uint32_t>(proto::SessionState::kClosed), std::memory_order_release);
  bump_and_wake(impl_->h->publish_word, nullptr);
  bump_and_wake(impl_->h->completion_word, nullptr);
  // The session's host pools end with it (a daemon restarted within the session re-maps its
  // rank's pool; nothing can use it after).
  const std::uint32_t pools = std::max<std::uint32_t>(1, impl_->groups.num_groups);
  for (std::uint32_t r = 0; r < impl_->geo.num_ranks; ++r) {
    if (!impl_->serves(r)) continue;  // no daemon of ours made one
    for (std::uint32_t g = 0; g < pools; ++g)
      SharedObject::remove(detail::session_object_name(impl_->generation, proto::host_pool_object(r, g)));
  }
}

namespace {

// The session's segment `name` of `bytes`. A leftover one is replaced only if its creator is gone
// (`replace_stale`), by the creator's lock on it, which every pid namespace sees.
Result<std::unique_ptr<SharedObject>, IpcErrc> create_segment(const std::string& name, std::uint64_t bytes,
                                                              bool replace_stale) {
  auto m = SharedObject::create(name, bytes);
  if (m.ok() || m.error().code != IpcErrc::kInUse) return m;
  // /dev/shm is everyone's: another user may have made the name first (and this one can neither
  // open nor remove it). Named, not a bare "already exists".
  struct stat st {};
  if (lstat(("/dev/shm/" + name).c_str(), &st) == 0 && st.st_uid != getuid())
    return make_error(IpcErrc::kInUse, "session " + name + " exists and belongs to uid " + std::to_string(st.st_uid) +
                                           " (another user made it first; /dev/shm is shared): remove it as that "
                                           "user or root, or choose another session suffix");
  auto old = SharedObject::open(name);
  const detail::CreatorLiveness creator = old.ok() ? detail::creator_liveness(**old) : detail::CreatorLiveness{};
  if (creator.alive)
    return make_error(IpcErrc::kInUse, "session " + name + " is owned by a live engine (" + creator.who + ")");
  if (!replace_stale)
    return make_error(IpcErrc::kInUse, "session " + name + " exists; its engine has exited (" + creator.who +
                                           ") and replace_stale is off");
  SharedObject::remove(name);
  return SharedObject::create(name, bytes);
}

// The engine's lock on its new segment `m`. A sweep moves a segment aside for a moment while it
// checks it (ipc/src/stale_sessions.cpp): look again before concluding the name is another's, and
// then leave the name alone (what it holds is not ours to unlink).
Result<ipc::LivenessLock, IpcErrc> lock_new_segment(SharedObject& m) {
  auto lock = ipc::LivenessLock::take(m.name(), m.inode(), ipc::kEngineLockByte);
  for (int tries = 0; !lock.ok() && lock.error().code == IpcErrc::kNotFound && tries < 100; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    lock = ipc::LivenessLock::take(m.name(), m.inode(), ipc::kEngineLockByte);
  }
  if (lock.ok()) return lock;
  if (lock.error().code == IpcErrc::kNotFound) m.set_unlink_on_destroy(false);
  return make_error(lock.error().code, "session " + m.name() + ": " + lock.error().message);
}

}  // namespace

Result<std::unique_ptr<EngineSession>, IpcErrc> EngineSession::create(const SessionOptions& o) {
  if (!proto::valid_session_suffix(o.suffix))
    return make_error(IpcErrc::kInvalidArgument, "session suffix '" + o.suffix + "' must be 1-64 of [A-Za-z0-9_.-]");
  const bool grouped = proto::is_group_session(o.groups);
  if (grouped) {
    const proto::CacheGeometry zero{};
    if (std::memcmp(&o.geometry, &zero, sizeof zero) != 0)
      return make_error(IpcErrc::kInvalidArgument, "a session with cache groups takes its shape from them: leave geometry zero");
  }
  const proto::CacheGeometry geometry = grouped ? proto::envelope_of(o.groups) : o.geometry;
  if (auto why = proto::session_cache_problem(geometry, o.groups); !why.empty())
    return make_error(IpcErrc::kInvalidArgument, "geometry: " + why);
  if (auto why = detail::check_ring_sizes(o.ring_bytes, o.completion_capacity); !why.empty())
    return make_error(IpcErrc::kInvalidArgument, why);
  if (o.rank_timeout_ns <= 0 || o.service_period_ns <= 0 || o.fence_timeout_ns <= 0)
    return make_error(IpcErrc::kInvalidArgument, "rank_timeout_ns, service_period_ns and fence_timeout_ns must be positive");
  if (o.max_uncollected_results == 0) return make_error(IpcErrc::kInvalidArgument, "max_uncollected_results must be positive");
  if (o.only_rank && *o.only_rank >= geometry.num_ranks)
    return make_error(IpcErrc::kInvalidArgument, "only_rank " + std::to_string(*o.only_rank) + " is not a rank of the " +
                                                     std::to_string(geometry.num_ranks) + "-rank geometry");
  if (auto why = proto::kv_identity_problem(o.kv_identity); !why.empty())
    return make_error(IpcErrc::kInvalidArgument, "kv_identity: " + why);
  if (grouped && o.kv_identity.kv_layout() != proto::KvLayout::kUndeclared)
    return make_error(IpcErrc::kInvalidArgument, "kv_identity: a session of cache groups declares each group's layout "
                                                 "by its kind (mla_latent is replicated); leave the layout undeclared");

  // Objects an engine killed with -9 left behind (its arenas, host pools no live daemon holds).
  (void)sweep_stale_objects();

  auto impl = std::make_unique<Impl>();
  impl->opts = o;
  impl->clock = o.clock ? o.clock : &monotonic_clock();
  impl->name = detail::session_name(o.suffix);
  impl->geo = geometry;
  impl->groups = o.groups;
  const auto layout = detail::compute_layout(geometry, o.ring_bytes, o.completion_capacity);

  KVTD_ASSIGN_OR_RETURN(impl->mapping, create_segment(impl->name, layout.total_bytes, o.replace_stale));
  impl->mapping->set_unlink_on_destroy(true);
  // The lock says "its creator lives" to every pid namespace; taken before the magic makes the
  // segment a session anyone reads.
  KVTD_ASSIGN_OR_RETURN(impl->liveness, lock_new_segment(*impl->mapping));
  impl->pid_namespace = ipc::own_pid_namespace();

  impl->view = detail::SessionView{impl->mapping->data(), layout, geometry.num_ranks, geometry.num_layers};
  impl->weight_version.store(o.weight_version);
  impl->h = detail::init_session(impl->view, geometry, o.groups, o.completion_capacity, impl->clock->now_ns());
  impl->generation = impl->h->generation;
  impl->h->take_over_host_tier = o.adopt_host_tier ? 1 : 0;
  impl->h->served_ranks = o.only_rank ? 1u << *o.only_rank : 0;
  impl->h->kv_identity = o.kv_identity;
  impl->h->engine_pid_namespace = impl->pid_namespace;
  impl->served = proto::ranks_served(impl->h->served_ranks, geometry.num_ranks);
  auto* h = impl->h;

  impl->ring = std::make_unique<TaskRingWriter>(h, impl->view.ring(), layout.ring_bytes, geometry.num_ranks);
  for (std::uint32_t r = 0; r < geometry.num_ranks; ++r)
    impl->completions.emplace_back(impl->view.completion_control(r), impl->view.completion_records(r),
                                   o.completion_capacity);
  {
    MutexLock g(impl->mu);  // no other thread yet; the lock keeps the analysis whole
    impl->merger = CompletionMerger(o.max_uncollected_results);
    impl->arena_tensor.assign(layout.registry_count, nullptr);
    impl->roster = RankRoster(geometry.num_ranks);
  }
  auto* raw = impl.get();
  impl->service_thread = std::thread([raw] { raw->service_loop(); });
  return std::unique_ptr<EngineSession>(new EngineSession(std::move(impl)));
}

Status<IpcErrc> EngineSession::register_tensor(const proto::TensorDesc& d) {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  MutexLock g(impl_->mu);
  return impl_->register_tensor(d);
}

Status<IpcErrc> EngineSession::publish() {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  MutexLock g(impl_->mu);
  auto* h = impl_->h;
  KVTD_TRY(impl_->registry_complete());
  h->state.store(static_cast<std::uint32_t>(proto::SessionState::kReady), std::memory_order_release);
  bump_and_wake(h->publish_word, nullptr);
  return {};
}

Status<IpcErrc> EngineSession::wait_ready(std::int64_t timeout_ns) {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  const std::int64_t deadline = deadline_after(impl_->clock->now_ns(), timeout_ns);
  const std::uint32_t want = proto::kReadyCacheAttached | proto::kReadyHostPool;
  for (;;) {
    if (impl_->closing.load(std::memory_order_seq_cst)) return impl_->closing_error();
    std::uint32_t missing = proto::kMaxRanks;
    for (std::uint32_t r = 0; r < impl_->geo.num_ranks; ++r) {
      const auto& s = impl_->h->ranks[r];
      if (!impl_->serves(r)) continue;
      if (!s.attached.load() || (s.ready_flags.load() & want) != want) {
        missing = r;
        break;
      }
    }
    if (missing == proto::kMaxRanks) return {};
    if (impl_->clock->now_ns() >= deadline)
      return make_error(IpcErrc::kTimeout, "rank " + std::to_string(missing) + " is not attached and ready after " +
                                               std::to_string(timeout_ns / 1'000'000) + " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void EngineSession::set_weight_version(std::uint64_t version) { impl_->weight_version.store(version); }

std::uint64_t EngineSession::weight_version() const { return impl_->weight_version.load(); }

Result<std::uint64_t, IpcErrc> EngineSession::submit_raw(const proto::TaskRecordHeader& header,
                                                         std::span<const std::int32_t> src,
                                                         std::span<const std::int32_t> dst) {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  if (header.kind == static_cast<std::uint16_t>(proto::TaskKind::kPadding) && header.format_version == proto::kPaddingFormat)
    return make_error(IpcErrc::kInvalidArgument, "a raw task may not carry the ring's padding marker");
  auto* impl = impl_.get();
  MutexLock g(impl->mu);
  impl->service(false);
  if (!impl->ring->fits(src.size(), dst.size())) return make_error(IpcErrc::kTooLarge, "raw task too large");
  if (auto id = impl->push_locked(header, src, dst)) return *id;
  return make_error(IpcErrc::kRingFull, "task ring full");
}

std::optional<TaskResult> EngineSession::poll(std::uint64_t task_id) {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return std::nullopt;
  MutexLock g(impl_->mu);
  impl_->service(false);
  return impl_->merger.take(task_id);
}

Result<TaskResult, IpcErrc> EngineSession::wait(std::uint64_t task_id, std::int64_t timeout_ns) {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  return impl_->wait_result(task_id, timeout_ns);
}

bool EngineSession::rank_alive(std::uint32_t rank) const {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return false;
  if (!impl_->serves(rank)) return false;
  const auto& s = impl_->h->ranks[rank];
  return s.attached.load() != 0 && impl_->clock->now_ns() - s.heartbeat_ns.load() <= impl_->opts.rank_timeout_ns;
}

std::uint32_t EngineSession::rank_ready_flags(std::uint32_t rank) const {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return 0;
  if (!rank_alive(rank)) return 0;
  return impl_->h->ranks[rank].ready_flags.load(std::memory_order_acquire);
}

std::size_t EngineSession::in_flight() const {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return 0;
  MutexLock g(impl_->mu);
  return impl_->merger.pending_count();
}

ForecastWaits EngineSession::forecast_waits() const {
  MutexLock g(impl_->mu);
  return impl_->swaps.waits();
}

const proto::CacheGeometry& EngineSession::geometry() const { return impl_->geo; }
const proto::CacheGroups& EngineSession::groups() const { return impl_->groups; }

const std::string& EngineSession::name() const { return impl_->name; }

std::uint64_t EngineSession::generation() const { return impl_->generation; }

}  // namespace kvtd::engine
