// rank_roster.h (client/engine internal) - the engine's private verdicts on each rank's daemon
// (what the shared segment cannot be trusted to hold): who was granted, whether it shares this
// engine's pid namespace, a fence asked for or under way, a fence that failed; and the moment from
// which heartbeat silence counts.
//
// Thread-safety: none (kept under the session's mutex; the service thread takes the fence jobs
// out under it and fences without it). Copyable and movable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvtd::engine {

class RankRoster {
 public:
  struct Rank {
    std::uint64_t owner = 0;  // owner word of the granted daemon
    // The granted daemon shares this engine's pid namespace: its pid and owner word name it
    // here, so it can be signalled. Else liveness is its lock on the segment and it cannot be
    // fenced from this side (ipc/liveness_lock.h).
    bool same_pid_namespace = true;
    // Its successor asked to attach while it was attached: the successor took the rank's lock,
    // which only an exited (or detached) daemon lets go, so across namespaces it is fenced.
    bool replaced = false;
    bool fencing = false;   // declared gone; its tasks fail once the fence ends
    bool unfenced = false;  // its fence failed: the process may live on with the cache mapped
    std::string why;        // why it was declared gone
  };
  // A fence the service thread runs without the session's mutex.
  struct FenceJob {
    std::uint32_t rank = 0;
    std::uint64_t owner = 0;
    bool same_pid_namespace = true;
    bool replaced = false;
  };

  explicit RankRoster(std::uint32_t ranks = 0) : ranks_(ranks) {}

  const Rank& operator[](std::uint32_t r) const { return ranks_[r]; }

  // The supervisor ran at `now`: the moment from which heartbeat ages count. When the engine
  // itself did not run for over half of `rank_timeout_ns` (its process or the machine stalled:
  // every heartbeat then looks old at once), it watches afresh from now instead of fencing ranks
  // that were merely not observed.
  std::int64_t watch_from(std::int64_t now, std::int64_t rank_timeout_ns);
  // Rank `r` was granted to the daemon `owner`.
  void granted(std::uint32_t r, std::uint64_t owner, bool same_pid_namespace);
  // Rank `r` is declared gone for `why`: no grant and no new verdict until its fence ends.
  void start_fence(std::uint32_t r, std::string why, bool replaced);
  // Every rank declared gone whose fence has not ended.
  std::vector<FenceJob> fence_jobs() const;
  // The fence of rank `r` ended, its daemon stopped (`fenced`) or not; returns why it was fenced.
  std::string fence_ended(std::uint32_t r, bool fenced);
  // Why cache control cannot go through rank `r` now (it may still map the cache), or "".
  std::string cache_control_refusal(std::uint32_t r) const;

 private:
  std::vector<Rank> ranks_;
  std::int64_t last_run_ns_ = 0;  // when watch_from() last ran
  std::int64_t watch_from_ns_ = 0;
};

}  // namespace kvtd::engine
