// A storage task's context: the RL key prefix, the stored name of each key, the write policy's
// selection.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/storage/object_format.h"
#include "kvtd/storage/object_name.h"
#include "kvtd/events/kv_events.h"
#include "kvtd/storage/object_store.h"
#include "executor_impl.h"

namespace kvtd::daemon {

namespace {

// The most objects one per-key use count map holds before it starts over (bounds memory).
constexpr std::size_t kMaxCountedKeys = 1u << 20;

}  // namespace

void StorageExecutor::Impl::note_weight_version(std::uint64_t wv) {
  if (t.kv_events == nullptr) return;
  bool changed = false;
  {
    MutexLock g(prefix_mu);
    changed = events_wv.has_value() && *events_wv != wv;
    events_wv = wv;
  }
  // Objects of the old weights stay in the store but no key of the new ones reaches them.
  if (changed) t.kv_events->cleared();
}

Result<std::string, config::ConfigErrc> StorageExecutor::Impl::key_prefix_for(std::uint64_t wv) {
  note_weight_version(wv);
  if (t.config.key_prefix_source.empty()) return t.config.key_prefix;
  MutexLock g(prefix_mu);
  if (prefix_known && wv == prefix_wv) return current_prefix;
  auto p = config::fastdeploy_key_prefix(t.config.key_prefix_source);
  if (!p.ok()) return std::move(p).error();
  if (!prefix_known || *p != current_prefix)
    KVTD_INFO("storage key prefix '{}' (weight version {}, from {}/version.yaml)", *p, wv, t.config.key_prefix_source);
  current_prefix = *p;
  prefix_wv = wv;
  prefix_known = true;
  return current_prefix;
}

std::string StorageExecutor::Impl::stored_key(const std::string& key, const std::string& key_prefix, std::uint64_t task_weight_version) const {
  const std::uint32_t slice_rank = t.replicated ? 0 : ep.rank();
  // FastDeploy's RL prefix (from version.yaml) joins the weight version: KV of other weights
  // is never found.
  return storage::StoredName{key, key_prefix, t.config.weight_version, task_weight_version, slice_rank}.encode();
}

void StorageExecutor::Impl::count_uses(const std::vector<std::string>& keys) {
  MutexLock g(count_mu);
  if (uses.size() + keys.size() > kMaxCountedKeys) uses.clear();
  for (const auto& k : keys) ++uses[k];
}

std::vector<std::size_t> StorageExecutor::Impl::selected_by_policy(const StorageWork& w) {
  const auto policy = t.config.write_policy;
  const auto& keys = w.section.keys;
  std::vector<std::size_t> which;
  if (w.header.flags & proto::kTaskFlagEvictBackup) {
    if (policy != config::WritePolicy::kWriteBack) return which;
  } else if (w.header.flags & proto::kTaskFlagPolicyBackup) {
    count_uses(keys);
    if (policy == config::WritePolicy::kNone || policy == config::WritePolicy::kWriteBack) return which;
    if (policy == config::WritePolicy::kWriteThroughSelective) {
      MutexLock g(count_mu);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        auto it = uses.find(keys[i]);
        if (it != uses.end() && it->second >= t.config.write_threshold) which.push_back(i);
      }
      return which;
    }
  }
  for (std::size_t i = 0; i < keys.size(); ++i) which.push_back(i);
  return which;
}

}  // namespace kvtd::daemon
