// rank_server.h (daemon-internal) - the daemon's life as a state machine, one session after
// another:
//
//   waiting --attach--> live <--clear / restore--> cleared
//      ^                  |                           |
//      +----- detached <--+---------------------------+   (session ended, lost, or stop)
//
// waiting: no session (RankEndpoint::attach waits for one). live: the engine's tensors are
// mapped and a TaskRunner serves the ring. cleared: a weight update closed every mapping;
// serve_cleared answers the ring until a restore maps the new tensors. detached: the session is
// over for this rank; the pool is removed unless we are stopping (a restarted daemon of the same
// session re-maps it). A sticky device error exits the process from live (exit 7).
//
// Thread-safety: run() on one thread; the services it borrows are thread-safe where shared.
#pragma once

#include <atomic>
#include <string>
#include <vector>
#include <cstdint>
#include <memory>
#include <optional>

#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/daemon/task_runner.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/ipc/liveness_lock.h"
#include "fastdeploy_ipc.h"
#include "heartbeat.h"
#include "start_up.h"

namespace kvtd::daemon {

class RankServer {
 public:
  // Borrows all three; they outlive the server.
  RankServer(const config::DaemonConfig& cfg, Services& services, std::atomic<bool>& stop)
      : cfg_(cfg), s_(services), stop_(stop) {}
  RankServer(const RankServer&) = delete;
  RankServer& operator=(const RankServer&) = delete;

  // Serves sessions until stop; returns the process exit code (exit_codes.h).
  int run();

 private:
  // One attached session's state.
  struct Session {
    endpoint::RankEndpoint& ep;
    HostPools& pools;  // one per cache group (one for a single-shape geometry)
    Heartbeat& heartbeat;
    std::optional<proto::TaskRecordHeader> restore_task;  // RESTORE_CACHE to complete once live
    // --create_cache_tensor: the cache this daemon made for FastDeploy's worker while mapped.
    std::unique_ptr<FastDeployOwnedCache> owned;
    TaskRunner::Exit why = TaskRunner::Exit::kStopped;  // why the session ended (kEnd)
    int exit_code = 0;                                   // the process must exit with it (kExit)
    std::int64_t granted_ns = 0;                         // when the engine granted it (monotonic)
    // The ready bits the host pools earn: kReadyHostPool, and kReadyHostTierTakenOver when they
    // are the ones this daemon kept from the suffix's dead previous session.
    std::uint32_t pool_ready = proto::kReadyHostPool;
  };
  // What a state hands over to: the next state, or the end of the session, or of the process.
  enum class Step { kLive, kCleared, kEnd, kExit };

  // run() but for the kept pools: serves one session after another until stopped or failed.
  int serve_sessions();
  // Attached session -> nullopt when it ended (wait for the next), else the exit code.
  std::optional<int> serve_session(endpoint::RankEndpoint& ep);
  Step cleared(Session& s);
  // This rank's host pools of the session (one per cache group), or the exit code.
  Result<HostPools, int> open_pools(const endpoint::RankEndpoint& ep);
  // Maps the tensors and serves them; `after_restore`: a failure keeps the rank cleared instead
  // of exiting (the engine clears and restores again).
  Step live(Session& s, bool after_restore);
  Result<AttachedCache, DeviceErrc> map_cache(Session& s);
  Step serve_mapped(Session& s, AttachedCache cache);
  // The cache was cleared: closes the mappings and completes the clear.
  void close_for_clear(Session& s, const TaskRunner& runner);
  void fail_restore(Session& s, const std::string& message);
  void end_session(Session& s);

  // Removes the pools kept from a dead engine's session (one taken over was renamed away).
  void drop_kept_pools();
  // The session ended: its pools are removed, or kept when its engine died (not closed) for the
  // engine's restart to take over; this daemon stays their holder, so no sweep removes them.
  void release_pools(Session& s);

  const config::DaemonConfig& cfg_;
  Services& s_;
  std::atomic<bool>& stop_;
  // The session whose engine died and whose pools (named by it, this rank and each cache group)
  // are left for the next session of the suffix to take over (RankEndpoint::take_over_host_tier);
  // 0: none. Only the run() thread.
  std::uint64_t kept_generation_ = 0;
  // The kept pools' holder locks (HostPools::release_holder_locks): this daemon is their live
  // holder in every pid namespace until they are taken over or dropped.
  std::vector<std::unique_ptr<ipc::LivenessLock>> kept_locks_;
};

}  // namespace kvtd::daemon
