// The stored names of a task's keys.
#include "stored_names.h"

#include "kvtd/daemon/log.h"
#include "kvtd/events/kv_events.h"
#include "kvtd/storage/object_name.h"

namespace kvtd::daemon {

void StoredNames::note_weight_version(std::uint64_t wv) {
  if (kv_events_ == nullptr) return;
  bool changed = false;
  {
    MutexLock g(mu_);
    changed = events_wv_.has_value() && *events_wv_ != wv;
    events_wv_ = wv;
  }
  // Objects of the old weights stay in the store but no key of the new ones reaches them.
  if (changed) kv_events_->cleared();
}

Result<std::string, config::ConfigErrc> StoredNames::key_prefix_for(std::uint64_t wv) {
  note_weight_version(wv);
  if (config_.key_prefix_source.empty()) return config_.key_prefix;
  MutexLock g(mu_);
  if (prefix_known_ && wv == prefix_wv_) return current_prefix_;
  KVTD_ASSIGN_OR_RETURN(const std::string p, config::fastdeploy_key_prefix(config_.key_prefix_source));
  if (!prefix_known_ || p != current_prefix_)
    KVTD_INFO("storage key prefix '{}' (weight version {}, from {}/version.yaml)", p, wv, config_.key_prefix_source);
  current_prefix_ = p;
  prefix_wv_ = wv;
  prefix_known_ = true;
  return current_prefix_;
}

std::string StoredNames::of(const std::string& key, const std::string& key_prefix, std::uint64_t task_weight_version,
                            std::uint32_t part) const {
  // FastDeploy's RL prefix (from version.yaml) joins the weight version: KV of other weights
  // is never found.
  return storage::StoredName{key, key_prefix, config_.weight_version, task_weight_version, slicing_.slice_of(part, rank_),
                             slicing_.by_head}
      .encode();
}

std::string StoredNames::of_group(const std::string& key, const std::string& key_prefix,
                                  std::uint64_t task_weight_version, bool replicated) const {
  return storage::StoredName{key, key_prefix, config_.weight_version, task_weight_version, replicated ? 0 : rank_, false}
      .encode();
}

}  // namespace kvtd::daemon
