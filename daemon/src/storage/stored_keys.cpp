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
#include "kvtd/events/kv_events.h"
#include "kvtd/storage/object_store.h"
#include "storage/executor_impl.h"

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
  return stored_name(key, key_prefix, t.config.weight_version, task_weight_version, slice_rank);
}

std::string stored_name(const std::string& key, const std::string& key_prefix, std::uint64_t config_weight_version,
                        std::uint64_t task_weight_version, std::uint32_t rank) {
  const std::string prefix = key_prefix.empty() ? "" : "." + key_prefix;
  return key + prefix + ".w" + std::to_string(config_weight_version) + "-" + std::to_string(task_weight_version) +
         ".r" + std::to_string(rank);
}

namespace {

// Strips `tail` from the end of `s` when `s` ends with it.
bool strip_suffix(std::string& s, const std::string& tail) {
  if (s.size() < tail.size() || s.compare(s.size() - tail.size(), tail.size(), tail) != 0) return false;
  s.resize(s.size() - tail.size());
  return true;
}

bool all_digits(const std::string& s, std::size_t from, std::size_t to) {
  if (from >= to) return false;
  for (std::size_t i = from; i < to; ++i)
    if (s[i] < '0' || s[i] > '9') return false;
  return true;
}

}  // namespace

std::optional<StoredName> parse_stored_name(const std::string& stored_name) {
  StoredName out;
  std::string s = stored_name;
  const auto r = s.rfind(".r");
  if (r == std::string::npos || !all_digits(s, r + 2, s.size()) || s.size() - r - 2 > 4) return std::nullopt;
  out.rank = static_cast<std::uint32_t>(std::stoul(s.substr(r + 2)));
  s.resize(r);
  const auto w = s.rfind(".w");
  const auto dash = s.find('-', w == std::string::npos ? 0 : w);
  if (w == std::string::npos || dash == std::string::npos || !all_digits(s, w + 2, dash) || !all_digits(s, dash + 1, s.size()) ||
      dash - w - 2 > 19 || s.size() - dash - 1 > 19)
    return std::nullopt;
  out.config_weight_version = std::stoull(s.substr(w + 2, dash - w - 2));
  out.task_weight_version = std::stoull(s.substr(dash + 1));
  s.resize(w);
  if (s.empty()) return std::nullopt;
  out.key = std::move(s);
  return out;
}

std::optional<std::string> engine_key_of(const std::string& stored_name, const std::string& key_prefix) {
  auto parsed = parse_stored_name(stored_name);
  if (!parsed) return std::nullopt;
  if (!key_prefix.empty() && !strip_suffix(parsed->key, "." + key_prefix)) return std::nullopt;
  if (parsed->key.empty()) return std::nullopt;
  return std::move(parsed->key);
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
