// swap_outcomes.h (daemon-internal) - the outcome of each SWAP_TO_HOST whose write-through backup
// follows it (kTaskFlagBackupPair), kept until that backup asks for it: a backup stores only the
// bytes its swap moved, so one whose swap was cancelled, missed its deadline or failed is skipped.
//
// Lifecycle of an entry: expect() as the swap is decoded (before it can complete, even inline);
// record() with every completion of the swap; take() by its backup as the backup starts, which the
// block tracker holds until the swap has completed and released its blocks. An entry whose backup
// never comes (the engine sent the flag alone, or the epoch was revoked) is dropped by forget() or
// forget_all(), so the map holds at most the swaps in flight.
//
// Thread-safety: every method from any thread (swaps complete on the lanes, backups start on the
// dispatcher). Not copyable.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>

#include "kvtd/base/mutex.h"
#include "kvtd/proto/task.h"

namespace kvtd::daemon {

class SwapOutcomes {
 public:
  SwapOutcomes() = default;
  SwapOutcomes(const SwapOutcomes&) = delete;
  SwapOutcomes& operator=(const SwapOutcomes&) = delete;

  // Swap `swap_id` was read and its backup will ask: kept, no outcome yet.
  void expect(std::uint64_t swap_id) EXCLUDES(mu_) {
    MutexLock g(mu_);
    outcomes_[swap_id] = std::nullopt;
  }
  // Swap `swap_id` completed with `status`; ignored unless expected.
  void record(std::uint64_t swap_id, proto::TaskStatus status) EXCLUDES(mu_) {
    MutexLock g(mu_);
    auto it = outcomes_.find(swap_id);
    if (it != outcomes_.end()) it->second = status;
  }
  // The swap's outcome, removed; nullopt when it was never expected or has not completed here
  // (either way nothing of it may be stored).
  std::optional<proto::TaskStatus> take(std::uint64_t swap_id) EXCLUDES(mu_) {
    MutexLock g(mu_);
    auto it = outcomes_.find(swap_id);
    if (it == outcomes_.end()) return std::nullopt;
    const auto status = it->second;
    outcomes_.erase(it);
    return status;
  }
  void forget(std::uint64_t swap_id) EXCLUDES(mu_) {
    MutexLock g(mu_);
    outcomes_.erase(swap_id);
  }
  void forget_all() EXCLUDES(mu_) {
    MutexLock g(mu_);
    outcomes_.clear();
  }
  std::size_t size() const EXCLUDES(mu_) {
    MutexLock g(mu_);
    return outcomes_.size();
  }

 private:
  mutable Mutex mu_;
  std::unordered_map<std::uint64_t, std::optional<proto::TaskStatus>> outcomes_ GUARDED_BY(mu_);
};

}  // namespace kvtd::daemon
