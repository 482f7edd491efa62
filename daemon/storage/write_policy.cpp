// Which keys of a write are stored.
#include "write_policy.h"

namespace kvtd::daemon {

namespace {

// The most keys the use counts hold before they start over (bounds memory).
constexpr std::size_t kMaxCountedKeys = 1u << 20;

}  // namespace

void WritePolicy::count_uses(const std::vector<std::string>& keys) {
  MutexLock g(mu_);
  if (uses_.size() + keys.size() > kMaxCountedKeys) uses_.clear();
  for (const auto& k : keys) ++uses_[k];
}

std::vector<std::size_t> WritePolicy::selected(const StorageWork& w) {
  const auto policy = config_.write_policy;
  const auto& keys = w.section.keys;
  std::vector<std::size_t> which;
  if (w.header.flags & proto::kTaskFlagEvictBackup) {
    if (policy != config::WritePolicy::kWriteBack) return which;
  } else if (w.header.flags & proto::kTaskFlagPolicyBackup) {
    count_uses(keys);
    if (policy == config::WritePolicy::kNone || policy == config::WritePolicy::kWriteBack) return which;
    if (policy == config::WritePolicy::kWriteThroughSelective) {
      MutexLock g(mu_);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        auto it = uses_.find(keys[i]);
        if (it != uses_.end() && it->second >= config_.write_threshold) which.push_back(i);
      }
      return which;
    }
  }
  for (std::size_t i = 0; i < keys.size(); ++i) which.push_back(i);
  return which;
}

}  // namespace kvtd::daemon
