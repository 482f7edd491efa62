// session_impl.h (client/engine internal) - EngineSession's private state, shared by the files that
// each hold one concern of it: the facade (engine_session.cpp), submission, completion merging,
// the rank supervisor (service thread), cache control, layer progress, the tensor registry and
// the host-backend arenas.
//
// Locking: `mu` guards the session's private state (GUARDED_BY below); `stop_mu` only the
// service thread's stop flag, and is never held while `mu` is taken. No lock is held across a
// wait in shared memory: waits drop `mu` first and every wait has a deadline.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvtd/base/mutex.h"
#include "cache_state.h"
#include "completion_merger.h"
#include "pending_swaps.h"
#include "rank_roster.h"
#include "kvtd/engine/engine_session.h"
#include "kvtd/ipc/liveness_lock.h"
#include "kvtd/ipc/rings.h"
#include "kvtd/ipc/segment.h"
#include "kvtd/ipc/shared_object.h"

namespace kvtd::engine {

// The session contract's names, used throughout the engine's end.
using namespace kvtd::ipc;  // NOLINT(google-build-using-namespace): a private header of this target only
namespace detail = ipc::detail;
using proto::TaskStatus;

// One record to push: header plus its two word lists (owned).
struct Encoded {
  proto::TaskRecordHeader hdr{};
  std::vector<std::int32_t> src, dst;
  std::vector<std::byte> events;  // engine event handles, one per rank (swap tasks), or none
  // Pushed right after the request's first record, with that record's id as its after-task (a
  // swap's backup: the daemon stores it only if that swap completed ok).
  bool after_first_record = false;
  std::uint64_t cancels = 0;  // a CANCEL: the task it names (its answer follows that task's outcome)
};

struct EngineSession::Impl {
  SessionOptions opts;
  const Clock* clock = nullptr;
  // This engine's lock on the segment (ipc/liveness_lock.h): how a sweep or a daemon in any pid
  // namespace tells that the session's creator lives. Held for the session's lifetime: declared
  // before the mapping, so it is released only after the mapping unlinked the name (released
  // first, another engine could take the name in between and lose its new segment to our unlink).
  ipc::LivenessLock liveness;
  std::unique_ptr<SharedObject> mapping;
  std::uint64_t pid_namespace = 0;     // this process's (ipc::own_pid_namespace)
  proto::SessionHeader* h = nullptr;   // for the atomics only
  detail::SessionView view;            // computed here, never read back from the header
  proto::CacheGeometry geo{};          // private copy of the geometry (a group session's envelope)
  proto::CacheGroups groups{};         // private copy of the cache groups (num_groups 0: none)
  std::uint32_t served = 0;            // rank bit mask (see all_ranks_mask); set once at create
  std::uint64_t generation = 0;
  std::unique_ptr<TaskRingWriter> ring;
  std::vector<CompletionRing> completions;
  std::vector<std::unique_ptr<SharedObject>> arenas GUARDED_BY(mu);  // host-backend device tensors
  std::vector<std::byte*> arena_tensor GUARDED_BY(mu);               // by registry index
  std::string name;

  // Lock order: stop_mu before mu (the service loop takes mu inside stop_mu's scope).
  mutable Mutex mu;
  CompletionMerger merger GUARDED_BY(mu);  // pending tasks and their merged results
  PendingSwaps swaps GUARDED_BY(mu);  // swaps in flight and their forecast (opts.completion_forecast)
  std::uint64_t next_task_id GUARDED_BY(mu) = 1;
  std::atomic<std::uint64_t> weight_version{0};
  CacheState cache GUARDED_BY(mu);  // across weight updates (mirrored to h->cache_state by set_cache_state)
  std::uint32_t arena_incarnation GUARDED_BY(mu) = 0;  // host-backend arenas made so far (new names after a clear)

  RankRoster roster GUARDED_BY(mu);  // per rank, private: who was granted, a fence asked for or failed
  // The fence of rank r's daemon when it runs in another pid namespace: by its lock on the
  // segment, never a signal (ipc/liveness_lock.h).
  ipc::FenceResult fence_across_namespaces(std::uint32_t r, bool replaced) const;
  std::atomic<std::uint32_t> fences_wanted{0};  // the service thread has fences to run (roster.fence_jobs)

  Mutex stop_mu ACQUIRED_BEFORE(mu);
  CondVar stop_cv;
  bool stopping GUARDED_BY(stop_mu) = false;
  std::thread service_thread;

  // Calls in flight, so that closing the session while another thread waits in it (ordinary
  // engine shutdown: a completion thread in wait(), the main thread closing) wakes that call
  // with kClosed and unmaps only once no call is inside. Both seq_cst: a call increments `calls`
  // then reads `closing`, the destructor sets `closing` then reads `calls`; one sees the other.
  std::atomic<std::uint32_t> calls{0};
  std::atomic<bool> closing{false};
  // The session belongs to the process that created it: a forked child shares the mapping but
  // not the engine's private state, and the two would take each other's completions.
  pid_t creator = getpid();

  Error<IpcErrc> closing_error() const;

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
  bool registry_writable() const REQUIRES(mu);

  // Every tensor of the geometry registered, or none at all (the daemons then open
  // the tensors FastDeploy's worker published by name: daemon/process/fastdeploy_ipc.h), or the
  // first one missing named.
  Status<IpcErrc> registry_complete() const REQUIRES(mu);

  // Sets the cache state, private and in the header (see proto::CacheState).
  void set_cache_state(bool cleared) REQUIRES(mu);

  // Validates and records one tensor in the registry (register_tensor's body).
  Status<IpcErrc> register_tensor(const proto::TensorDesc& d) REQUIRES(mu);
  // Unregisters and frees the host-backend arenas (free_host_device_tensors' body).
  Status<IpcErrc> free_arenas() REQUIRES(mu);

  Result<std::uint64_t, IpcErrc> submit_encoded(std::vector<Encoded>& records, std::int64_t timeout_ns,
                                                bool cache_control);
  Result<TaskResult, IpcErrc> wait_result(std::uint64_t task_id, std::int64_t timeout_ns);
  Result<TaskResult, IpcErrc> run_cache_control(proto::TaskKind kind, std::uint16_t flags, std::int64_t timeout_ns);

  // The ranks this session serves (SessionOptions::only_rank; every rank of the geometry by
  // default): the only ones it grants, waits for, expects results from and registers tensors of.
  std::uint32_t all_ranks_mask() const { return served; }
  bool serves(std::uint32_t r) const { return r < 32 && (served & (1u << r)) != 0; }

  void wake_completion_waiters() { bump_and_wake(h->completion_word, &h->completion_waiters); }

  // A rank's completion record into the merger (a record naming a rank outside the geometry is
  // ignored).
  void merge(const proto::CompletionRecord& rec) REQUIRES(mu);

  // Fails every task still waiting for `rank`.
  void fail_rank(std::uint32_t rank, TaskStatus status, const std::string& why) REQUIRES(mu);

  // Stops routing tasks to rank r and hands it to the service thread to fence: its
  // pending tasks fail only once it can no longer write (or, if it cannot be stopped, with
  // kRankUnfenced so the engine keeps their destination blocks out of use).
  void start_fence(std::uint32_t r, std::string why, bool replaced = false) REQUIRES(mu);

  // drain completions, grant attach requests, declare stale ranks gone.
  void service(bool check_pids) REQUIRES(mu);

  // Service thread, without mu: fences every rank waiting for it, then fails its tasks.
  void run_fences() EXCLUDES(mu);

  // Appends the task (a fresh task id and submit time) and records it as pending
  // for the ranks in `expected` (default: every rank); nullopt when the ring has no room now.
  // `cancels`: a CANCEL's target (the merger answers it by that task's outcome).
  std::optional<std::uint64_t> push_locked(proto::TaskRecordHeader hdr, std::span<const std::int32_t> src,
                                           std::span<const std::int32_t> dst, std::uint32_t expected = 0,
                                           std::span<const std::byte> events = {}, std::uint64_t cancels = 0) REQUIRES(mu);

  void service_loop();
};

}  // namespace kvtd::engine
