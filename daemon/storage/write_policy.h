// write_policy.h (daemon/storage private) - which keys of a STORAGE_WRITE are stored, by its flags
// and --write-policy: every key of an explicit write; for backups, none, all (write-through), or
// those used at least --write-threshold times (write-through-selective); evict backups only under
// write-back. Loads and queries count uses too.
//
// Thread-safety: every method may be called from any thread. Not copyable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/storage_executor.h"

namespace kvtd::daemon {

class WritePolicy {
 public:
  explicit WritePolicy(const config::StorageConfig& config) : config_(config) {}
  WritePolicy(const WritePolicy&) = delete;
  WritePolicy& operator=(const WritePolicy&) = delete;

  // Indices into w's keys that a write stores; the rest count as skipped.
  std::vector<std::size_t> selected(const StorageWork& w) EXCLUDES(mu_);
  // One use of each of `keys` (a load, a query, a backup), for write-through-selective.
  void count_uses(const std::vector<std::string>& keys) EXCLUDES(mu_);

 private:
  const config::StorageConfig& config_;
  Mutex mu_;
  std::unordered_map<std::string, std::uint32_t> uses_ GUARDED_BY(mu_);  // bounded: starts over past 2^20 keys
};

}  // namespace kvtd::daemon
