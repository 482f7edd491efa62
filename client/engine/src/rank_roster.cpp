// The engine's private verdicts on each rank's daemon.
#include "rank_roster.h"

#include <utility>

namespace kvtd::engine {

std::int64_t RankRoster::watch_from(std::int64_t now, std::int64_t rank_timeout_ns) {
  if (last_run_ns_ != 0 && now - last_run_ns_ > rank_timeout_ns / 2) watch_from_ns_ = now;
  last_run_ns_ = now;
  return watch_from_ns_;
}

void RankRoster::granted(std::uint32_t r, std::uint64_t owner, bool same_pid_namespace) {
  Rank& rank = ranks_[r];
  rank.owner = owner;
  rank.same_pid_namespace = same_pid_namespace;
  rank.unfenced = false;
}

void RankRoster::start_fence(std::uint32_t r, std::string why, bool replaced) {
  Rank& rank = ranks_[r];
  rank.fencing = true;
  rank.replaced = replaced;
  rank.why = std::move(why);
}

std::vector<RankRoster::FenceJob> RankRoster::fence_jobs() const {
  std::vector<FenceJob> jobs;
  for (std::uint32_t r = 0; r < ranks_.size(); ++r)
    if (ranks_[r].fencing) jobs.push_back({r, ranks_[r].owner, ranks_[r].same_pid_namespace, ranks_[r].replaced});
  return jobs;
}

std::string RankRoster::fence_ended(std::uint32_t r, bool fenced) {
  Rank& rank = ranks_[r];
  if (!fenced) rank.unfenced = true;
  rank.fencing = false;
  rank.owner = 0;
  return rank.why;
}

std::string RankRoster::cache_control_refusal(std::uint32_t r) const {
  const Rank& rank = ranks_[r];
  if (!rank.fencing && !rank.unfenced) return "";
  return "rank " + std::to_string(r) + " went silent and " +
         (rank.fencing ? "is being stopped" : "could not be stopped") + ": it may still have the cache mapped";
}

}  // namespace kvtd::engine
