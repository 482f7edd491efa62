#include "kvtd/base/mutex.h"
#include "kvtd/ipc/engine_session.h"
#include "kvtd/ipc/task_codec.h"

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <map>
#include <unordered_map>

#include "kvtd/ipc/populate.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/rings.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "segment.h"

namespace kvtd::ipc {

using proto::TaskStatus;

const char* ipc_errc_name(IpcErrc e) {
  switch (e) {
    case IpcErrc::kInvalidArgument: return "invalid_argument";
    case IpcErrc::kNotFound: return "not_found";
    case IpcErrc::kPermission: return "permission";
    case IpcErrc::kBadMagic: return "bad_magic";
    case IpcErrc::kBadVersion: return "bad_version";
    case IpcErrc::kGeometryMismatch: return "geometry_mismatch";
    case IpcErrc::kInUse: return "in_use";
    case IpcErrc::kTimeout: return "timeout";
    case IpcErrc::kRingFull: return "ring_full";
    case IpcErrc::kTooLarge: return "too_large";
    case IpcErrc::kTooManyInFlight: return "too_many_in_flight";
    case IpcErrc::kNotReady: return "not_ready";
    case IpcErrc::kUnknownTask: return "unknown_task";
    case IpcErrc::kTaskFailed: return "task_failed";
    case IpcErrc::kClosed: return "closed";
    case IpcErrc::kNoSpace: return "no_space";
    case IpcErrc::kCorrupt: return "corrupt";
    case IpcErrc::kSystem: return "system";
    case IpcErrc::kCacheCleared: return "cache_cleared";
    case IpcErrc::kWrongProcess: return "wrong_process";
  }
  return "unknown";
}

namespace {

struct Pending {
  std::uint64_t seq = 0;       // ring sequence number: locates the layer progress slot
  std::uint32_t expected = 0;  // rank bit mask
  std::uint32_t reported = 0;
  TaskResult result;
};

// One record to push: header plus its two word lists (owned).
struct Encoded {
  proto::TaskRecordHeader hdr{};
  std::vector<std::int32_t> src, dst;
};

}  // namespace

struct EngineSession::Impl {
  SessionOptions opts;
  const Clock* clock = nullptr;
  std::unique_ptr<SharedObject> mapping;
  proto::SessionHeader* h = nullptr;   // for the atomics only
  detail::SessionView view;            // computed here, never read back from the header
  proto::CacheGeometry geo{};          // private copy of the geometry
  std::uint64_t generation = 0;
  std::unique_ptr<TaskRingWriter> ring;
  std::vector<CompletionRing> completions;
  std::vector<std::unique_ptr<SharedObject>> arenas GUARDED_BY(mu);  // host-backend device tensors
  std::vector<std::byte*> arena_tensor GUARDED_BY(mu);               // by registry index
  std::string name;

  // Lock order: stop_mu before mu (the service loop takes mu inside stop_mu's scope).
  mutable Mutex mu;
  std::unordered_map<std::uint64_t, Pending> pending GUARDED_BY(mu);
  std::map<std::uint64_t, TaskResult> done GUARDED_BY(mu);  // ordered by id: the oldest is dropped first
  std::uint64_t next_task_id GUARDED_BY(mu) = 1;
  std::atomic<std::uint64_t> weight_version{0};
  // Weight updates (mirrored to h->cache_state): tasks are refused while cleared;
  // tensors may be registered again once every rank confirmed the clear.
  bool cache_cleared GUARDED_BY(mu) = false;
  bool clear_confirmed GUARDED_BY(mu) = false;
  std::uint32_t arena_incarnation GUARDED_BY(mu) = 0;  // host-backend arenas made so far (new names after a clear)

  // Per rank, private: who was granted, and a fence in progress.
  struct RankState {
    std::uint64_t owner = 0;  // owner word of the granted daemon
    bool fencing = false;     // declared gone; tasks fail once the fence ends
    bool unfenced = false;    // its fence failed: the process may live on with the cache mapped
    std::string why;
  };
  std::vector<RankState> rank_state GUARDED_BY(mu);
  std::atomic<std::uint32_t> fences_wanted{0};

  Mutex stop_mu ACQUIRED_BEFORE(mu);
  CondVar stop_cv;
  bool stopping GUARDED_BY(stop_mu) = false;
  std::thread service_thread;

  // Calls in flight, so that closing the session while another thread waits in it (ordinary
  // engine shutdown: a completion thread in wait(), the main thread closing) wakes that call
  // with kClosed and unmaps only once no call is inside. Both seq_cst: a call increments `calls`
  // then reads `closing`, the destructor sets `closing` then reads `calls`; one sees the other.
  std::int64_t last_service_ns GUARDED_BY(mu) = 0;  // when service() last ran (any thread)
  std::int64_t watch_from_ns GUARDED_BY(mu) = 0;    // heartbeat ages count from here at most
  std::atomic<std::uint32_t> calls{0};
  std::atomic<bool> closing{false};
  // The session belongs to the process that created it: a forked child shares the mapping but
  // not the engine's private state, and the two would take each other's completions.
  pid_t creator = getpid();

  Error<IpcErrc> closing_error() const {
    return make_error(IpcErrc::kClosed, "session " + name + " is being closed");
  }

  // Marks one public call in flight; check() refuses it in a forked child or while closing.
  class Gate {
   public:
    explicit Gate(Impl* impl) : impl_(impl) { impl_->calls.fetch_add(1, std::memory_order_seq_cst); }
    // The decrement is the call's last touch of the session: once the count reaches zero the
    // closing thread may free it (so no notify here; close() polls). Release: everything the call
    // did happens before the closer's acquire load that sees it gone.
    ~Gate() { impl_->calls.fetch_sub(1, std::memory_order_release); }
    Gate(const Gate&) = delete;
    Gate& operator=(const Gate&) = delete;

    Status<IpcErrc> check() const {
      if (getpid() != impl_->creator)
        return make_error(IpcErrc::kWrongProcess, "session " + impl_->name + " was created by process " +
                                                      std::to_string(impl_->creator) + ", not this one (" +
                                                      std::to_string(getpid()) +
                                                      "): a forked child must create its own session");
      if (impl_->closing.load(std::memory_order_seq_cst)) return impl_->closing_error();
      return {};
    }
    bool usable() const { return check().ok(); }

   private:
    Impl* impl_;
  };

  // Whether no daemon may be reading the registry: before publish, or once every
  // rank confirmed a clear.
  bool registry_writable() const REQUIRES(mu) {
    return h->state.load() == static_cast<std::uint32_t>(proto::SessionState::kCreating) ||
           (cache_cleared && clear_confirmed);
  }

  // Every tensor of the geometry registered, or none at all (the daemons then open
  // the tensors FastDeploy's worker published by name: daemon/src/fastdeploy_ipc.h), or the
  // first one missing named.
  Status<IpcErrc> registry_complete() const REQUIRES(mu) {
    const auto* reg = view.registry();
    bool any = false;
    for (std::uint64_t i = 0; i < view.layout.registry_count; ++i) any = any || reg[i].valid != 0;
    if (!any) return {};
    for (std::uint32_t r = 0; r < geo.num_ranks; ++r)
      for (std::uint32_t l = 0; l < geo.num_layers; ++l)
        for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
          const auto kind = static_cast<proto::TensorKind>(k);
          if (geo.has_tensor(kind) && !reg[proto::registry_index(geo, r, l, kind)].valid)
            return make_error(IpcErrc::kInvalidArgument, std::string("tensor ") + proto::tensor_kind_name(kind) +
                                                             " of rank " + std::to_string(r) + " layer " +
                                                             std::to_string(l) + " is not registered");
        }
    return {};
  }

  // Sets the cache state, private and in the header (see proto::CacheState).
  void set_cache_state(bool cleared) REQUIRES(mu) {
    cache_cleared = cleared;
    if (!cleared) clear_confirmed = false;
    h->cache_state.store(static_cast<std::uint32_t>(cleared ? proto::CacheState::kCleared : proto::CacheState::kLive),
                         std::memory_order_release);
  }

  // Validates and records one tensor in the registry (register_tensor's body).
  Status<IpcErrc> register_tensor(const proto::TensorDesc& d) REQUIRES(mu);
  // Unregisters and frees the host-backend arenas (free_host_device_tensors' body).
  Status<IpcErrc> free_arenas() REQUIRES(mu);

  Result<std::uint64_t, IpcErrc> submit_encoded(std::vector<Encoded>& records, std::int64_t timeout_ns,
                                                bool cache_control);
  Result<TaskResult, IpcErrc> wait_result(std::uint64_t task_id, std::int64_t timeout_ns);
  Result<TaskResult, IpcErrc> run_cache_control(proto::TaskKind kind, std::uint16_t flags, std::int64_t timeout_ns);

  std::uint32_t all_ranks_mask() const { return geo.num_ranks >= 32 ? ~0u : (1u << geo.num_ranks) - 1; }

  void wake_completion_waiters() { bump_and_wake(h->completion_word, &h->completion_waiters); }

  void finish_if_complete(std::uint64_t id, Pending& p) REQUIRES(mu) {
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

  void record_report(Pending& p, std::uint32_t rank, TaskStatus status, std::uint64_t blocks,
                     std::string message, std::uint64_t skipped = 0) REQUIRES(mu) {
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

  void merge(const proto::CompletionRecord& rec) REQUIRES(mu) {
    auto it = pending.find(rec.task_id);
    if (it == pending.end() || rec.rank >= geo.num_ranks) return;
    std::string msg(rec.message, strnlen(rec.message, sizeof rec.message));
    record_report(it->second, rec.rank, static_cast<TaskStatus>(rec.status), rec.blocks_done,
                  std::move(msg), rec.blocks_skipped);
    finish_if_complete(rec.task_id, it->second);
  }

  // Fails every task still waiting for `rank`.
  void fail_rank(std::uint32_t rank, TaskStatus status, const std::string& why) REQUIRES(mu) {
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

  // Stops routing tasks to rank r and hands it to the service thread to fence: its
  // pending tasks fail only once it can no longer write (or, if it cannot be stopped, with
  // kRankUnfenced so the engine keeps their destination blocks out of use).
  void start_fence(std::uint32_t r, std::string why) REQUIRES(mu) {
    auto& s = h->ranks[r];
    s.attached.store(0, std::memory_order_release);
    rank_state[r].fencing = true;
    rank_state[r].why = std::move(why);
    fences_wanted.fetch_add(1, std::memory_order_release);
    bump_and_wake(h->space_word, &h->producer_waiters);  // its ring bytes are no longer reserved
  }

  // drain completions, grant attach requests, declare stale ranks gone.
  void service(bool check_pids) REQUIRES(mu) {
    proto::CompletionRecord rec;
    for (auto& ring_r : completions)
      while (ring_r.try_pop(rec)) merge(rec);

    const std::int64_t now = clock->now_ns();
    // A rank is dead after rank_timeout of heartbeat silence that this engine was awake to see.
    // When the engine itself did not run for a while (its process or the machine stalled: every
    // heartbeat then looks old at once), it watches afresh from now instead of fencing ranks
    // that were merely not observed.
    if (last_service_ns != 0 && now - last_service_ns > opts.rank_timeout_ns / 2) watch_from_ns = now;
    last_service_ns = now;
    for (std::uint32_t r = 0; r < geo.num_ranks; ++r) {
      auto& s = h->ranks[r];
      if (rank_state[r].fencing) continue;  // no grant and no new verdict until the fence ends
      const std::uint32_t req = s.attach_request.load(std::memory_order_acquire);
      const bool attached = s.attached.load(std::memory_order_relaxed) != 0;
      if (req != 0 && req != s.attached_epoch.load(std::memory_order_relaxed)) {
        if (attached) {
          // A new epoch while the old one is attached: a restarted daemon. The old process must be
          // gone before its tasks fail and the new one is granted.
          start_fence(r, "rank " + std::to_string(r) + " restarted");
          continue;
        }
        rank_state[r].owner = s.owner.load(std::memory_order_acquire);
        rank_state[r].unfenced = false;
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
      } else if (check_pids) {
        const auto pid = static_cast<pid_t>(s.pid.load(std::memory_order_relaxed));
        if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH)
          start_fence(r, "rank " + std::to_string(r) + " process " + std::to_string(pid) + " exited");
      }
    }
  }

  // Service thread, without mu: fences every rank waiting for it, then fails its tasks.
  void run_fences() EXCLUDES(mu) {
    if (fences_wanted.load(std::memory_order_acquire) == 0) return;
    std::vector<std::pair<std::uint32_t, std::uint64_t>> jobs;
    {
      MutexLock g(mu);
      fences_wanted.store(0, std::memory_order_relaxed);
      for (std::uint32_t r = 0; r < geo.num_ranks; ++r)
        if (rank_state[r].fencing) jobs.emplace_back(r, rank_state[r].owner);
    }
    for (auto [r, owner] : jobs) {
      const FenceResult f = opts.fencer ? opts.fencer(owner, opts.fence_timeout_ns)
                                        : fence_process(owner, opts.fence_timeout_ns);
      MutexLock g(mu);
      auto& st = rank_state[r];
      if (f.outcome == FenceOutcome::kFenced) {
        fail_rank(r, TaskStatus::kRankDead, st.why + "; " + f.detail);
      } else {
        st.unfenced = true;
        fail_rank(r, TaskStatus::kRankUnfenced,
                  st.why + "; it could not be stopped (" + f.detail +
                      "), so it may still write this task's destination blocks: keep them out of use");
      }
      st.fencing = false;
      st.owner = 0;
      bump_and_wake(h->publish_word, &h->consumer_waiters);  // a waiting successor may be granted now
    }
  }

  // Appends the task (a fresh task id and submit time) and records it as pending
  // for the ranks in `expected` (default: every rank); nullopt when the ring has no room now.
  std::optional<std::uint64_t> push_locked(proto::TaskRecordHeader hdr, std::span<const std::int32_t> src,
                                           std::span<const std::int32_t> dst, std::uint32_t expected = 0) REQUIRES(mu) {
    hdr.task_id = next_task_id;
    hdr.submit_ns = clock->now_ns();
    std::uint64_t seq = 0;
    if (!ring->try_push(hdr, src, dst, &seq)) return std::nullopt;
    ++next_task_id;
    Pending p;
    p.seq = seq;
    p.expected = expected != 0 ? expected : all_ranks_mask();
    p.result.task_id = hdr.task_id;
    p.result.submit_ns = hdr.submit_ns;
    pending.emplace(hdr.task_id, std::move(p));
    bump_and_wake(h->publish_word, &h->consumer_waiters);
    return hdr.task_id;
  }

  void service_loop() {
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
};

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
  for (std::uint32_t r = 0; r < impl_->geo.num_ranks; ++r)
    SharedObject::remove(detail::session_object_name(impl_->generation, "host" + std::to_string(r)));
}

Result<std::unique_ptr<EngineSession>, IpcErrc> EngineSession::create(const SessionOptions& o) {
  if (!proto::valid_session_suffix(o.suffix))
    return make_error(IpcErrc::kInvalidArgument, "session suffix '" + o.suffix + "' must be 1-64 of [A-Za-z0-9_.-]");
  if (auto why = detail::check_geometry(o.geometry); !why.empty())
    return make_error(IpcErrc::kInvalidArgument, "geometry: " + why);
  if (auto why = detail::check_ring_sizes(o.ring_bytes, o.completion_capacity); !why.empty())
    return make_error(IpcErrc::kInvalidArgument, why);
  if (o.rank_timeout_ns <= 0 || o.service_period_ns <= 0 || o.fence_timeout_ns <= 0)
    return make_error(IpcErrc::kInvalidArgument, "rank_timeout_ns, service_period_ns and fence_timeout_ns must be positive");
  if (o.max_uncollected_results == 0) return make_error(IpcErrc::kInvalidArgument, "max_uncollected_results must be positive");

  // Objects an engine killed with -9 left behind (its arenas, its daemons' host pools).
  (void)sweep_stale_objects();

  auto impl = std::make_unique<Impl>();
  impl->opts = o;
  impl->clock = o.clock ? o.clock : &monotonic_clock();
  impl->name = detail::session_name(o.suffix);
  impl->geo = o.geometry;
  const auto layout = detail::compute_layout(o.geometry, o.ring_bytes, o.completion_capacity);

  auto m = SharedObject::create(impl->name, layout.total_bytes);
  if (!m.ok() && m.error().code == IpcErrc::kInUse) {
    // A leftover segment: replace it only if its creator is gone.
    auto old = SharedObject::open(impl->name);
    pid_t creator = 0;
    if (old.ok() && (*old)->size() >= sizeof(proto::SessionHeader))
      creator = static_cast<pid_t>(reinterpret_cast<proto::SessionHeader*>((*old)->data())->creator_pid);
    const bool alive = creator > 0 && (kill(creator, 0) == 0 || errno != ESRCH);
    if (alive || !o.replace_stale)
      return make_error(IpcErrc::kInUse, "session " + impl->name + " is owned by live process " + std::to_string(creator));
    SharedObject::remove(impl->name);
    m = SharedObject::create(impl->name, layout.total_bytes);
  }
  if (!m.ok()) return std::move(m).error();
  impl->mapping = std::move(m).value();
  impl->mapping->set_unlink_on_destroy(true);

  // Construct every control block in place (the memory is zero-filled by the kernel), so each
  // atomic begins its life as an object.
  std::byte* base = impl->mapping->data();
  auto* h = new (base) proto::SessionHeader();
  impl->view.base = base;
  impl->view.layout = layout;
  impl->view.num_ranks = o.geometry.num_ranks;
  impl->view.num_layers = o.geometry.num_layers;
  for (std::uint32_t r = 0; r < o.geometry.num_ranks; ++r) {
    new (impl->view.completion_control(r)) proto::CompletionRingControl();
    auto* pc = new (impl->view.progress_control(r)) proto::ProgressControl();
    auto* slots = reinterpret_cast<proto::LayerProgressSlot*>(pc + 1);
    for (std::uint32_t i = 0; i < proto::kProgressSlots; ++i) new (&slots[i]) proto::LayerProgressSlot();
  }
  new (impl->view.agreement_control()) proto::AgreementControl();
  for (std::uint32_t r = 0; r < o.geometry.num_ranks; ++r)
    for (std::uint32_t i = 0; i < proto::kAgreementSlots; ++i) new (impl->view.agreement_slot(r, i)) std::atomic<std::uint64_t>(0);
  impl->weight_version.store(o.weight_version);
  h->layout_version = proto::kSessionLayoutVersion;
  h->header_bytes = sizeof(proto::SessionHeader);
  h->generation = (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}() ^
                  static_cast<std::uint64_t>(monotonic_now_ns());
  impl->generation = h->generation;
  h->creator_pid = static_cast<std::uint32_t>(getpid());
  h->creator_uid = static_cast<std::uint32_t>(getuid());
  h->completion_capacity = o.completion_capacity;
  h->geometry = o.geometry;
  h->registry_offset = layout.registry_offset;
  h->registry_count = layout.registry_count;
  h->task_ring_offset = layout.ring_offset;
  h->task_ring_bytes = layout.ring_bytes;
  h->completion_offset = layout.completion_offset;
  h->completion_stride = layout.completion_stride;
  h->progress_offset = layout.progress_offset;
  h->progress_stride = layout.progress_stride;
  h->total_bytes = layout.total_bytes;
  h->engine_pid.store(static_cast<std::uint32_t>(getpid()));
  h->engine_heartbeat_ns.store(impl->clock->now_ns());
  h->state.store(static_cast<std::uint32_t>(proto::SessionState::kCreating));
  // Magic last, with release: a daemon that acquires a non-zero magic sees every field above; one
  // that maps a half-built segment sees 0 and keeps waiting.
  std::atomic_ref<std::uint64_t>(h->magic).store(proto::kSessionMagic, std::memory_order_release);
  impl->h = h;

  impl->ring = std::make_unique<TaskRingWriter>(h, impl->view.ring(), layout.ring_bytes, o.geometry.num_ranks);
  for (std::uint32_t r = 0; r < o.geometry.num_ranks; ++r)
    impl->completions.emplace_back(impl->view.completion_control(r), impl->view.completion_records(r),
                                   o.completion_capacity);
  {
    MutexLock g(impl->mu);  // no other thread yet; the lock keeps the analysis whole
    impl->arena_tensor.assign(layout.registry_count, nullptr);
    impl->rank_state.assign(o.geometry.num_ranks, Impl::RankState{});
  }
  auto* raw = impl.get();
  impl->service_thread = std::thread([raw] { raw->service_loop(); });
  return std::unique_ptr<EngineSession>(new EngineSession(std::move(impl)));
}

Status<IpcErrc> EngineSession::register_tensor(const proto::TensorDesc& d) {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  MutexLock g(impl_->mu);
  return impl_->register_tensor(d);
}

Status<IpcErrc> EngineSession::Impl::register_tensor(const proto::TensorDesc& d) {
  if (!registry_writable())
    return make_error(IpcErrc::kInvalidArgument,
                      "tensors can only be registered before publish(), or while clear_caches() has every rank's "
                      "mappings released");
  if (d.rank >= geo.num_ranks || d.layer >= geo.num_layers || d.kind >= proto::kTensorKinds)
    return make_error(IpcErrc::kInvalidArgument, "tensor rank " + std::to_string(d.rank) + " layer " +
                                                     std::to_string(d.layer) + " kind " + std::to_string(d.kind) +
                                                     " is outside the geometry");
  const auto kind = static_cast<proto::TensorKind>(d.kind);
  if (!geo.has_tensor(kind))
    return make_error(IpcErrc::kInvalidArgument,
                      std::string("the geometry has no ") + proto::tensor_kind_name(kind) + " tensor");
  // check_geometry bounded this product below 2^56 at create().
  const std::uint64_t need = geo.block_bytes(kind) * static_cast<std::uint64_t>(geo.device_blocks(d.layer));
  std::uint64_t end = 0;
  if (!proto::checked_add(d.offset, d.bytes, &end))
    return make_error(IpcErrc::kInvalidArgument, "tensor offset " + std::to_string(d.offset) + " plus " +
                                                     std::to_string(d.bytes) + " bytes overflows");
  if (d.bytes < need)
    return make_error(IpcErrc::kInvalidArgument, std::string(proto::tensor_kind_name(kind)) + " tensor of layer " +
                                                     std::to_string(d.layer) + " has " + std::to_string(d.bytes) +
                                                     " bytes, the geometry needs " + std::to_string(need));
  // No device has 2^48 bytes (256 TiB): a size or offset beyond it is a caller's bug (a negative
  // number through an unsigned type), not a tensor.
  constexpr std::uint64_t kMaxTensorEnd = std::uint64_t{1} << 48;
  if (end > kMaxTensorEnd)
    return make_error(IpcErrc::kInvalidArgument, std::string(proto::tensor_kind_name(kind)) + " tensor of layer " +
                                                     std::to_string(d.layer) + ": offset " + std::to_string(d.offset) +
                                                     " plus " + std::to_string(d.bytes) +
                                                     " bytes is beyond any device (2^48 bytes)");
  auto& slot = view.registry()[proto::registry_index(geo, d.rank, d.layer, kind)];
  slot = d;
  slot.valid = 1;
  return {};
}

Status<IpcErrc> EngineSession::free_host_device_tensors() {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  MutexLock g(impl_->mu);
  return impl_->free_arenas();
}

Status<IpcErrc> EngineSession::Impl::free_arenas() {
  if (!registry_writable())
    return make_error(IpcErrc::kInvalidArgument,
                      "the host-backend tensors can only be freed before publish(), or after clear_caches()");
  auto* reg = view.registry();
  for (std::size_t i = 0; i < arena_tensor.size(); ++i)
    if (arena_tensor[i] != nullptr) {
      reg[i].valid = 0;
      arena_tensor[i] = nullptr;
    }
  arenas.clear();  // unmaps and unlinks each arena
  return {};
}

// Under mu throughout: the arenas, their tensor addresses and the registry change together (an
// engine thread reading host_device_tensor meanwhile used to race with this).
Status<IpcErrc> EngineSession::create_host_device_tensors() {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  MutexLock lock(impl_->mu);
  const auto& g = impl_->geo;
  if (!impl_->arenas.empty())
    if (auto st = impl_->free_arenas(); !st.ok()) return st;
  const std::uint32_t incarnation = impl_->arena_incarnation++;
  for (std::uint32_t r = 0; r < g.num_ranks; ++r) {
    std::uint64_t total = 0;
    for (std::uint32_t l = 0; l < g.num_layers; ++l)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
        const auto bytes = g.block_bytes(static_cast<proto::TensorKind>(k)) * static_cast<std::uint64_t>(g.device_blocks(l));
        total += (bytes + 255) / 256 * 256;
      }
    // Named by uid and generation, not by suffix, so the name always fits the 64-byte handle
    // and a sweep can tell whose session it belonged to.
    // After a clear the new arenas get new names (incarnation * 1000 + rank; kMaxRanks < 1000), so a
    // daemon can never open a freed arena's successor by its old handle.
    const std::string arena =
        detail::session_object_name(impl_->generation, "dev" + std::to_string(incarnation * 1000 + r));
    SharedObject::remove(arena);
    auto m = SharedObject::create(arena, total);
    if (!m.ok()) return std::move(m).error();
    (*m)->set_unlink_on_destroy(true);
    std::uint64_t offset = 0;
    for (std::uint32_t l = 0; l < g.num_layers; ++l)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
        const auto kind = static_cast<proto::TensorKind>(k);
        if (!g.has_tensor(kind)) continue;
        proto::TensorDesc d = describe_tensor(g, r, l, kind);
        d.device_id = -1;
        d.offset = offset;
        std::memcpy(d.handle, arena.c_str(), arena.size() + 1);
        if (auto st = impl_->register_tensor(d); !st.ok()) return st;
        impl_->arena_tensor[proto::registry_index(g, r, l, kind)] = (*m)->data() + offset;
        offset += (d.bytes + 255) / 256 * 256;
      }
    impl_->arenas.push_back(std::move(m).value());
  }
  return {};
}

std::byte* EngineSession::host_device_tensor(std::uint32_t rank, std::uint32_t layer, proto::TensorKind kind) const {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return nullptr;
  const auto& g = impl_->geo;
  if (rank >= g.num_ranks || layer >= g.num_layers) return nullptr;
  MutexLock lock(impl_->mu);
  return impl_->arena_tensor[proto::registry_index(g, rank, layer, kind)];
}

proto::TensorDesc describe_tensor(const proto::CacheGeometry& g, std::uint32_t rank, std::uint32_t layer,
                                  proto::TensorKind kind) {
  proto::TensorDesc d{};
  const bool data = kind == proto::TensorKind::kKey || kind == proto::TensorKind::kValue;
  d.rank = rank;
  d.layer = layer;
  d.kind = static_cast<std::uint32_t>(kind);
  d.dtype = data ? g.dtype : 0;
  d.ndim = data ? 4 : 3;
  const std::int64_t* s = (kind == proto::TensorKind::kKey || kind == proto::TensorKind::kKeyScale) ? g.key_shape : g.value_shape;
  for (std::uint32_t i = 0; i < d.ndim; ++i) d.shape[i] = s[i];
  d.shape[0] = g.device_blocks(layer);
  d.bytes = g.block_bytes(kind) * static_cast<std::uint64_t>(g.device_blocks(layer));
  return d;
}

Status<IpcErrc> EngineSession::publish() {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  MutexLock g(impl_->mu);
  auto* h = impl_->h;
  if (auto st = impl_->registry_complete(); !st.ok()) return st;
  h->state.store(static_cast<std::uint32_t>(proto::SessionState::kReady), std::memory_order_release);
  bump_and_wake(h->publish_word, nullptr);
  return {};
}

Status<IpcErrc> EngineSession::wait_ready(std::int64_t timeout_ns) {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  const std::int64_t deadline = deadline_after(impl_->clock->now_ns(), timeout_ns);
  const std::uint32_t want = proto::kReadyCacheAttached | proto::kReadyHostPool;
  for (;;) {
    if (impl_->closing.load(std::memory_order_seq_cst)) return impl_->closing_error();
    std::uint32_t missing = proto::kMaxRanks;
    for (std::uint32_t r = 0; r < impl_->geo.num_ranks; ++r) {
      const auto& s = impl_->h->ranks[r];
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

namespace {

Status<IpcErrc> check_keys(std::span<const std::string> keys) {
  if (keys.size() > proto::kMaxKeysPerTask)
    return make_error(IpcErrc::kInvalidArgument, std::to_string(keys.size()) + " keys exceed the limit of " +
                                                     std::to_string(proto::kMaxKeysPerTask) + " per task");
  for (std::size_t i = 0; i < keys.size(); ++i)
    if (!valid_engine_key(keys[i]))
      return make_error(IpcErrc::kInvalidArgument, "key " + std::to_string(i) + " ('" + keys[i].substr(0, 40) +
                                                       "') is not 1-" + std::to_string(proto::kMaxKeyBytes) +
                                                       " characters of [A-Za-z0-9_.:-]");
  return {};
}

Encoded encode_storage(proto::TaskKind kind, std::uint16_t flags, const TaskRequest& req,
                       std::span<const std::string> keys, std::span<const std::int32_t> blocks,
                       std::uint64_t weight_version) {
  Encoded e;
  e.hdr.kind = static_cast<std::uint16_t>(kind);
  e.hdr.flags = flags;
  e.hdr.format_version = proto::kTaskFormatVersion;
  e.hdr.deadline_ns = req.deadline_ns;
  e.hdr.after_task_id = req.after_task_id;
  e.hdr.num_keys = static_cast<std::uint32_t>(keys.size());
  proto::StorageTaskArgs args{};
  args.weight_version = weight_version;
  args.cancel_task_id = req.cancel_task_id;
  args.min_hits = req.min_hits;
  e.src = encode_storage_section(args, keys);
  e.dst.assign(blocks.begin(), blocks.end());
  return e;
}

// Turns a request into the records it submits (a swap with keys adds its backup), or an error.
Result<std::vector<Encoded>, IpcErrc> encode_request(const TaskRequest& req, std::uint64_t weight_version) {
  using proto::TaskKind;
  std::vector<Encoded> out;
  const auto kind = req.kind;
  if (kind == TaskKind::kSwapToHost || kind == TaskKind::kSwapToDevice) {
    Encoded e;
    e.hdr.kind = static_cast<std::uint16_t>(kind);
    e.hdr.format_version = proto::kTaskFormatVersion;
    e.hdr.after_task_id = req.after_task_id;
    e.hdr.deadline_ns = req.deadline_ns;
    if (req.layerwise) {
      if (kind != TaskKind::kSwapToDevice)
        return make_error(IpcErrc::kInvalidArgument, "layer-by-layer is only for SWAP_TO_DEVICE tasks");
      e.hdr.flags = proto::kTaskFlagLayerwise;
    }
    e.src.assign(req.src.begin(), req.src.end());
    e.dst.assign(req.dst.begin(), req.dst.end());
    out.push_back(std::move(e));
    if (!req.keys.empty()) {
      if (kind != TaskKind::kSwapToHost)
        return make_error(IpcErrc::kInvalidArgument, "keys on a swap are only for SWAP_TO_HOST (its backup)");
      if (req.keys.size() != req.dst.size())
        return make_error(IpcErrc::kInvalidArgument, std::to_string(req.keys.size()) + " keys for " +
                                                         std::to_string(req.dst.size()) + " destination host blocks");
      if (auto st = check_keys(req.keys); !st.ok()) return std::move(st).error();
      TaskRequest backup = req;
      backup.after_task_id = 0;  // ordered after the swap by its blocks
      out.push_back(encode_storage(TaskKind::kStorageWrite,
                                   proto::kTaskFlagHostBlocks | proto::kTaskFlagPolicyBackup, backup, req.keys,
                                   req.dst, weight_version));
    }
    return out;
  }
  if (proto::is_cache_control_kind(kind))
    return make_error(IpcErrc::kInvalidArgument, std::string(proto::task_kind_name(kind)) +
                                                     " is submitted by clear_caches() / restore_caches()");
  if (!proto::is_storage_kind(kind))
    return make_error(IpcErrc::kInvalidArgument, "task kind " + std::to_string(static_cast<unsigned>(kind)) +
                                                     " is reserved or unknown");
  if (req.layerwise) return make_error(IpcErrc::kInvalidArgument, "layer-by-layer is only for SWAP_TO_DEVICE tasks");
  if (!req.src.empty() || !req.dst.empty())
    return make_error(IpcErrc::kInvalidArgument, std::string(proto::task_kind_name(kind)) +
                                                     " takes keys and blocks, not src/dst");
  if (auto st = check_keys(req.keys); !st.ok()) return std::move(st).error();
  std::uint16_t flags = req.host_blocks ? proto::kTaskFlagHostBlocks : 0;
  switch (kind) {
    case TaskKind::kStorageQuery:
      if (!req.blocks.empty()) return make_error(IpcErrc::kInvalidArgument, "STORAGE_QUERY takes keys only");
      flags = 0;
      break;
    case TaskKind::kCancel:
      if (!req.keys.empty() || !req.blocks.empty() || req.cancel_task_id == 0)
        return make_error(IpcErrc::kInvalidArgument, "CANCEL takes only cancel_task_id (non-zero)");
      flags = 0;
      break;
    case TaskKind::kPrefetch:
      if (!req.host_blocks) return make_error(IpcErrc::kInvalidArgument, "PREFETCH loads into host blocks only");
      [[fallthrough]];
    default:
      if (req.keys.size() != req.blocks.size())
        return make_error(IpcErrc::kInvalidArgument, std::to_string(req.keys.size()) + " keys for " +
                                                         std::to_string(req.blocks.size()) + " blocks");
      if (req.evict_backup) {
        if (kind != TaskKind::kStorageWrite || !req.host_blocks)
          return make_error(IpcErrc::kInvalidArgument, "evict_backup is for STORAGE_WRITE of host blocks");
        flags |= proto::kTaskFlagEvictBackup;
      }
  }
  out.push_back(encode_storage(kind, flags, req, req.keys, req.blocks, weight_version));
  return out;
}

}  // namespace

Result<std::uint64_t, IpcErrc> EngineSession::submit(const TaskRequest& req) {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  auto encoded = encode_request(req, impl_->weight_version.load());
  if (!encoded.ok()) return std::move(encoded).error();
  return impl_->submit_encoded(*encoded, req.submit_timeout_ns, false);
}

// Cache-control tasks (CLEAR_CACHE / RESTORE_CACHE) go to the ranks attached now: one that is
// not attached maps nothing, and reads the cache state after its grant. Every other task is
// refused while the cache is cleared and needs every rank attached.
Result<std::uint64_t, IpcErrc> EngineSession::Impl::submit_encoded(std::vector<Encoded>& records,
                                                                   std::int64_t timeout_ns, bool cache_control) {
  auto* impl = this;
  std::uint64_t need = 0;
  for (const auto& e : records) need += proto::task_record_bytes(static_cast<std::uint32_t>(e.src.size()),
                                                                 static_cast<std::uint32_t>(e.dst.size()));
  for (const auto& e : records)
    // fits() keeps one record within half the ring (room for wrap padding); a swap and its backup
    // go in together, so they must fit there together.
    if (!impl->ring->fits(e.src.size(), e.dst.size()) ||
        (records.size() > 1 && need > impl->view.layout.ring_bytes / 2))
      return make_error(IpcErrc::kTooLarge, "a task of " + std::to_string(need) + " bytes (" +
                                                std::to_string(e.src.size() + e.dst.size()) +
                                                " words) cannot fit in a " +
                                                std::to_string(impl->view.layout.ring_bytes) + "-byte task ring");
  const std::int64_t deadline = deadline_after(impl->clock->now_ns(), timeout_ns);
  for (;;) {
    if (closing.load(std::memory_order_seq_cst)) return closing_error();
    const std::uint32_t space_seen = h->space_word.load(std::memory_order_acquire);
    const std::uint32_t done_seen = h->completion_word.load(std::memory_order_acquire);
    bool wait_space = false;
    {
      MutexLock g(impl->mu);
      impl->service(false);
      std::uint32_t expected = 0;
      if (!cache_control && impl->cache_cleared)
        return make_error(IpcErrc::kCacheCleared, "the KV cache of session " + impl->name +
                                                      " is cleared for a weight update: restore_caches() first");
      for (std::uint32_t r = 0; r < impl->geo.num_ranks; ++r) {
        if (cache_control && (impl->rank_state[r].fencing || impl->rank_state[r].unfenced))
          return make_error(IpcErrc::kNotReady, "rank " + std::to_string(r) + " went silent and " +
                                                    (impl->rank_state[r].fencing ? "is being stopped"
                                                                                 : "could not be stopped") +
                                                    ": it may still have the cache mapped");
        if (h->ranks[r].attached.load(std::memory_order_acquire)) expected |= 1u << r;
        else if (!cache_control)
          return make_error(IpcErrc::kNotReady, "rank " + std::to_string(r) + " is not attached to session " + impl->name);
      }
      if (expected == 0) return std::uint64_t{0};  // cache control with no rank attached: nothing to tell
      if (impl->pending.size() + records.size() <= impl->opts.completion_capacity) {
        // All records of a request go in together (a swap and its backup get consecutive ids):
        // with 2 x need free, padding before a wrap (less than one record) cannot starve the second.
        if (records.size() == 1 || impl->ring->free_bytes() >= 2 * need) {
          std::uint64_t first = 0;
          bool pushed = true;
          for (std::size_t i = 0; i < records.size() && pushed; ++i) {
            auto id = impl->push_locked(records[i].hdr, records[i].src, records[i].dst, expected);
            pushed = id.has_value();
            if (pushed && i == 0) first = *id;
          }
          if (pushed) return first;
          if (records.size() > 1) return make_error(IpcErrc::kSystem, "task ring refused a record it had room for");
        }
        wait_space = true;
      }
      const std::int64_t now = impl->clock->now_ns();
      if (now >= deadline) {
        if (wait_space)
          return make_error(IpcErrc::kRingFull, "task ring full: " + std::to_string(impl->ring->free_bytes()) +
                                                    " bytes free, task needs " + std::to_string(need) +
                                                    "; ranks did not consume within " +
                                                    std::to_string(timeout_ns / 1'000'000) + " ms");
        return make_error(IpcErrc::kTooManyInFlight, std::to_string(impl->pending.size()) +
                                                         " tasks in flight, the completion capacity");
      }
    }
    const std::int64_t slice = std::min(deadline, monotonic_now_ns() + impl->opts.service_period_ns);
    if (wait_space)
      (void)wait_on_word(h->space_word, space_seen, slice, &h->producer_waiters, 5'000);
    else
      (void)wait_on_word(h->completion_word, done_seen, slice, &h->completion_waiters, 5'000);
  }
}

// Submits one cache-control task and waits for its merged result. Ok when every rank that got
// it reported ok, or left for good (kRankDead: fenced or detached in order, so it maps nothing).
Result<TaskResult, IpcErrc> EngineSession::Impl::run_cache_control(proto::TaskKind kind, std::uint16_t flags,
                                                                  std::int64_t timeout_ns) {
  std::vector<Encoded> records(1);
  records[0].hdr.kind = static_cast<std::uint16_t>(kind);
  records[0].hdr.flags = flags;
  records[0].hdr.format_version = proto::kTaskFormatVersion;
  const std::int64_t deadline = deadline_after(clock->now_ns(), timeout_ns);
  auto id = submit_encoded(records, timeout_ns, true);
  if (!id.ok()) return std::move(id).error();
  if (*id == 0) return TaskResult{};  // no rank attached
  std::int64_t left = deadline - clock->now_ns();
  auto r = wait_result(*id, left > 0 ? left : 0);
  if (!r.ok()) return std::move(r).error();
  for (const auto& f : r->failures)
    if (f.status != TaskStatus::kRankDead)
      return make_error(IpcErrc::kTaskFailed, std::string(proto::task_kind_name(kind)) + " failed on rank " +
                                                  std::to_string(f.rank) + ": " + proto::task_status_name(f.status) +
                                                  ": " + f.message);
  return r;
}

Result<TaskResult, IpcErrc> EngineSession::clear_caches(const ClearOptions& options) {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  auto* impl = impl_.get();
  {
    MutexLock g(impl->mu);
    if (impl->h->state.load() != static_cast<std::uint32_t>(proto::SessionState::kReady))
      return make_error(IpcErrc::kInvalidArgument, "clear_caches() needs a published session");
    impl->set_cache_state(true);
    impl->clear_confirmed = false;
  }
  auto r = impl->run_cache_control(proto::TaskKind::kClearCache,
                                   options.drop_host_tier ? proto::kTaskFlagDropHostTier : 0, options.timeout_ns);
  // On failure the cache stays cleared but unconfirmed: tasks are refused, tensors must not be
  // freed; clear again (or restore) once the cause is fixed.
  if (!r.ok()) return r;
  if (options.weight_version) impl->weight_version.store(*options.weight_version);
  MutexLock g(impl->mu);
  if (impl->cache_cleared) impl->clear_confirmed = true;  // unless a restore raced us
  return r;
}

Result<TaskResult, IpcErrc> EngineSession::restore_caches(std::int64_t timeout_ns) {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  auto* impl = impl_.get();
  {
    MutexLock g(impl->mu);
    if (!impl->cache_cleared) return make_error(IpcErrc::kInvalidArgument, "the cache is not cleared: nothing to restore");
    if (auto st = impl->registry_complete(); !st.ok()) return std::move(st).error();
    // Live in the header before RESTORE_CACHE is in the ring: a rank granted from now on maps
    // the new registry itself. Tasks stay refused here until RESTORE_CACHE is submitted, so none
    // lands in the ring before it.
    impl->h->cache_state.store(static_cast<std::uint32_t>(proto::CacheState::kLive), std::memory_order_release);
    impl->clear_confirmed = false;
  }
  std::vector<Encoded> records(1);
  records[0].hdr.kind = static_cast<std::uint16_t>(proto::TaskKind::kRestoreCache);
  records[0].hdr.format_version = proto::kTaskFormatVersion;
  const std::int64_t deadline = deadline_after(impl->clock->now_ns(), timeout_ns);
  auto id = impl->submit_encoded(records, timeout_ns, true);
  {
    MutexLock g(impl->mu);
    impl->set_cache_state(!id.ok());
  }
  if (!id.ok()) return std::move(id).error();
  if (*id == 0) return TaskResult{};
  const std::int64_t left = deadline - impl->clock->now_ns();
  auto r = impl->wait_result(*id, left > 0 ? left : 0);
  std::string why;
  if (!r.ok()) {
    why = r.error().message;
  } else {
    for (const auto& f : r->failures)
      if (f.status != TaskStatus::kRankDead && why.empty())
        why = "RESTORE_CACHE failed on rank " + std::to_string(f.rank) + ": " + proto::task_status_name(f.status) +
              ": " + f.message;
  }
  if (why.empty()) return r;
  // A rank that could not re-open fails every task (cache_cleared): back to cleared, so the
  // engine refuses tasks instead; clear_caches() then restore_caches() again after fixing it.
  MutexLock g(impl->mu);
  impl->set_cache_state(true);
  return make_error(r.ok() ? IpcErrc::kTaskFailed : r.error().code,
                    why + "; the cache stays cleared: clear_caches() and restore_caches() again");
}

bool EngineSession::cache_cleared() const {
  MutexLock g(impl_->mu);
  return impl_->cache_cleared;
}

Result<std::uint64_t, IpcErrc> EngineSession::submit_raw(const proto::TaskRecordHeader& header,
                                                         std::span<const std::int32_t> src,
                                                         std::span<const std::int32_t> dst) {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
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
  auto it = impl_->done.find(task_id);
  if (it == impl_->done.end()) return std::nullopt;
  TaskResult r = std::move(it->second);
  impl_->done.erase(it);
  return r;
}

Result<TaskResult, IpcErrc> EngineSession::wait(std::uint64_t task_id, std::int64_t timeout_ns) {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  return impl_->wait_result(task_id, timeout_ns);
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

Status<IpcErrc> EngineSession::wait_layer(std::uint64_t task_id, std::uint32_t layer, std::int64_t timeout_ns,
                                          LayerStage stage) {
  const Impl::Gate gate(impl_.get());
  if (auto st = gate.check(); !st.ok()) return std::move(st).error();
  auto* impl = impl_.get();
  auto* h = impl->h;
  if (layer >= impl->geo.num_layers)
    return make_error(IpcErrc::kInvalidArgument, "layer " + std::to_string(layer) + " is out of range: the session has " +
                                                     std::to_string(impl->geo.num_layers) + " layers");
  const std::int64_t deadline = deadline_after(impl->clock->now_ns(), timeout_ns);
  for (;;) {
    if (impl->closing.load(std::memory_order_seq_cst)) return impl->closing_error();
    const std::uint32_t progress_seen = h->progress_word.load(std::memory_order_acquire);
    const std::uint32_t done_seen = h->completion_word.load(std::memory_order_acquire);
    {
      MutexLock g(impl->mu);
      impl->service(false);
      if (auto it = impl->done.find(task_id); it != impl->done.end()) {
        if (it->second.ok()) return {};
        const auto& f = it->second.failures.front();
        return make_error(IpcErrc::kTaskFailed, "task " + std::to_string(task_id) + " failed on rank " +
                                                    std::to_string(f.rank) + ": " + f.message);
      }
      auto it = impl->pending.find(task_id);
      if (it == impl->pending.end())
        return make_error(IpcErrc::kUnknownTask, "task " + std::to_string(task_id) + " is not pending");
      bool all = true;
      for (std::uint32_t r = 0; r < impl->geo.num_ranks && all; ++r) {
        if (it->second.reported & (1u << r)) continue;  // that rank finished the whole task
        auto* slot = impl->view.progress_slot(r, it->second.seq);
        const std::uint64_t before = slot->task_id.load(std::memory_order_acquire);
        const std::uint32_t reached = stage == LayerStage::kDone ? slot->layers_done.load(std::memory_order_acquire)
                                                                 : slot->layers_enqueued.load(std::memory_order_acquire);
        const std::uint64_t after = slot->task_id.load(std::memory_order_acquire);
        all = before == task_id && after == task_id && reached > layer;
      }
      if (all) return {};
    }
    const std::int64_t now = impl->clock->now_ns();
    if (now >= deadline)
      return make_error(IpcErrc::kTimeout, "layer " + std::to_string(layer) + " of task " + std::to_string(task_id) +
                                               " not complete after " + std::to_string(timeout_ns / 1'000'000) + " ms");
    const std::int64_t slice = std::min(deadline, monotonic_now_ns() + impl->opts.service_period_ns);
    // Progress and completions both end this wait; watch progress, re-check completions per slice.
    if (h->completion_word.load(std::memory_order_acquire) == done_seen)
      (void)wait_on_word(h->progress_word, progress_seen, slice, &h->progress_waiters);
  }
}

std::optional<std::array<std::uint8_t, proto::kHandleBytes>> EngineSession::layer_event_handle(
    std::uint32_t rank, std::uint32_t layer) const {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return std::nullopt;
  const auto& v = impl_->view;
  if (rank >= impl_->geo.num_ranks || layer >= impl_->geo.num_layers) return std::nullopt;
  auto* control = v.progress_control(rank);
  const auto& slot = impl_->h->ranks[rank];
  // Acquire pairs with the rank's release of events_published: the handle words are complete.
  const std::uint32_t n = control->events_published.load(std::memory_order_acquire);
  const std::uint32_t epoch = control->events_epoch.load(std::memory_order_relaxed);
  if (n <= layer) return std::nullopt;
  // Only the live daemon's events: one exported by a process that has since died is undefined
  // behaviour to open.
  if (!slot.attached.load(std::memory_order_acquire) || slot.attached_epoch.load(std::memory_order_acquire) != epoch)
    return std::nullopt;
  std::array<std::uint8_t, proto::kHandleBytes> out{};
  auto* words = reinterpret_cast<std::uint64_t*>(v.event_handle(rank, layer));
  // Acquire on every word (no fence: TSan cannot model one): the re-check below cannot move
  // before any of these loads.
  for (std::size_t w = 0; w < proto::kHandleBytes / 8; ++w) {
    const std::uint64_t x = std::atomic_ref<std::uint64_t>(words[w]).load(std::memory_order_acquire);
    std::memcpy(out.data() + 8 * w, &x, 8);
  }
  // Overwritten while we copied (a restarted daemon): not a handle of any one exporter.
  if (control->events_published.load(std::memory_order_relaxed) != n ||
      control->events_epoch.load(std::memory_order_relaxed) != epoch)
    return std::nullopt;
  return out;
}

bool EngineSession::rank_alive(std::uint32_t rank) const {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return false;
  if (rank >= impl_->geo.num_ranks) return false;
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
  return impl_->pending.size();
}

const proto::CacheGeometry& EngineSession::geometry() const { return impl_->geo; }
const std::string& EngineSession::name() const { return impl_->name; }
std::uint64_t EngineSession::generation() const { return impl_->generation; }

}  // namespace kvtd::ipc
