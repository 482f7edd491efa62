// stored_names.h (daemon/storage private) - the stored name of each key of a storage task: the
// RL key prefix of the task's weight version (read from FastDeploy's version.yaml when set), the
// deployment's and the task's weight versions, and the slice it holds (the rank's, or a run of KV
// heads: kvtd/proto/object_slices.h).
//
// Thread-safety: every method may be called from any thread. Not copyable.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvtd/base/mutex.h"
#include "kvtd/config/daemon_config.h"
#include "kvtd/proto/object_slices.h"

namespace kvtd::events {
class KvEventPublisher;
}

namespace kvtd::daemon {

class StoredNames {
 public:
  // `slicing`: how rank `rank`'s blocks are cut into objects. `kv_events` (may be null, not owned)
  // hears when the task weight version changes.
  StoredNames(const config::StorageConfig& config, const proto::ObjectSlicing& slicing, std::uint32_t rank,
              events::KvEventPublisher* kv_events)
      : config_(config), slicing_(slicing), rank_(rank), kv_events_(kv_events) {}
  StoredNames(const StoredNames&) = delete;
  StoredNames& operator=(const StoredNames&) = delete;

  // FastDeploy's RL key prefix for tasks of the engine's weight version `wv`: read from
  // version.yaml again when the version changes (the engine changes it at FastDeploy's sync
  // points only, so a version.yaml the trainer rewrites mid-serving is not picked up early).
  // An unreadable file fails the task: a guessed prefix could load KV of other weights.
  Result<std::string, config::ConfigErrc> key_prefix_for(std::uint64_t wv) EXCLUDES(mu_);

  // The stored name of part `part` (< slicing.parts) of this rank's slice of `key`
  // (kvtd/storage/object_name.h).
  std::string of(const std::string& key, const std::string& key_prefix, std::uint64_t task_weight_version,
                 std::uint32_t part) const;
  // The stored name of this rank's object of `key` in a cache group's namespace (one object per
  // block, by rank; rank 0's for a `replicated` group).
  std::string of_group(const std::string& key, const std::string& key_prefix, std::uint64_t task_weight_version,
                       bool replicated) const;

 private:
  // The last task weight version seen, for KV events: a change clears what routers know.
  void note_weight_version(std::uint64_t wv) EXCLUDES(mu_);

  const config::StorageConfig& config_;
  const proto::ObjectSlicing slicing_;
  const std::uint32_t rank_;
  events::KvEventPublisher* const kv_events_;
  Mutex mu_;  // the prefix cache; never held across a wait
  bool prefix_known_ GUARDED_BY(mu_) = false;
  std::uint64_t prefix_wv_ GUARDED_BY(mu_) = 0;
  std::string current_prefix_ GUARDED_BY(mu_);
  std::optional<std::uint64_t> events_wv_ GUARDED_BY(mu_);
};

}  // namespace kvtd::daemon
