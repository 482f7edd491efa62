// Per cache group figures (a session with cache groups): each group's host pool and the bytes
// swaps and storage tasks moved of it, labelled by group and kind.
#include <cstdio>

#include "kvtd/base/mutex.h"
#include "kvtd/metrics/registry.h"
#include "exposition_line.h"

namespace kvtd::metrics {
namespace {

using detail::line;

}  // namespace

void MetricsRegistry::set_cache_groups(std::vector<GroupFigures> groups) {
  if (groups.size() > kMaxGroups) groups.resize(kMaxGroups);
  MutexLock g(store_mu_);
  groups_ = std::move(groups);
}

std::vector<MetricsRegistry::GroupFigures> MetricsRegistry::cache_groups() const {
  MutexLock g(store_mu_);
  return groups_;
}

void MetricsRegistry::group_swap_bytes(std::uint32_t group, Direction d, std::uint64_t bytes) {
  if (group >= kMaxGroups || (d != Direction::kToHost && d != Direction::kToDevice)) return;
  group_bytes_[group][d == Direction::kToHost ? 0 : 1].fetch_add(bytes, std::memory_order_relaxed);
}

std::uint64_t MetricsRegistry::group_swap_bytes(std::uint32_t group, Direction d) const {
  if (group >= kMaxGroups || (d != Direction::kToHost && d != Direction::kToDevice)) return 0;
  return group_bytes_[group][d == Direction::kToHost ? 0 : 1].load(std::memory_order_relaxed);
}

void MetricsRegistry::group_storage_bytes(std::uint32_t group, Direction d, std::uint64_t bytes) {
  if (group >= kMaxGroups || (d != Direction::kStorageRead && d != Direction::kStorageWrite)) return;
  group_bytes_[group][static_cast<std::size_t>(d)].fetch_add(bytes, std::memory_order_relaxed);
}

std::uint64_t MetricsRegistry::group_storage_bytes(std::uint32_t group, Direction d) const {
  if (group >= kMaxGroups || (d != Direction::kStorageRead && d != Direction::kStorageWrite)) return 0;
  return group_bytes_[group][static_cast<std::size_t>(d)].load(std::memory_order_relaxed);
}

void MetricsRegistry::render_groups(std::string& out) const {
  const std::vector<GroupFigures> groups = cache_groups();
  if (groups.empty()) return;
  out += "# HELP kvtd_cache_group_host_pool_bytes Bytes of the host pool of each cache group.\n"
         "# TYPE kvtd_cache_group_host_pool_bytes gauge\n";
  for (std::size_t i = 0; i < groups.size(); ++i)
    line(out, "kvtd_cache_group_host_pool_bytes{group=\"%zu\",kind=\"%s\"} %llu\n", i, groups[i].kind.c_str(),
         static_cast<unsigned long long>(groups[i].host_pool_bytes));
  out += "# HELP kvtd_cache_group_swap_bytes_total Bytes swaps moved of each cache group's blocks, by direction.\n"
         "# TYPE kvtd_cache_group_swap_bytes_total counter\n";
  for (std::size_t i = 0; i < groups.size(); ++i)
    for (int d = 0; d < 2; ++d)
      line(out, "kvtd_cache_group_swap_bytes_total{group=\"%zu\",kind=\"%s\",direction=\"%s\"} %llu\n", i,
           groups[i].kind.c_str(), d == 0 ? "to_host" : "to_device",
           static_cast<unsigned long long>(group_bytes_[i][static_cast<std::size_t>(d)].load(std::memory_order_relaxed)));
  out += "# HELP kvtd_cache_group_storage_bytes_total Bytes storage tasks moved of each cache group's objects, by "
         "direction.\n"
         "# TYPE kvtd_cache_group_storage_bytes_total counter\n";
  for (std::size_t i = 0; i < groups.size(); ++i)
    for (int d = 2; d < 4; ++d)
      line(out, "kvtd_cache_group_storage_bytes_total{group=\"%zu\",kind=\"%s\",direction=\"%s\"} %llu\n", i,
           groups[i].kind.c_str(), d == 2 ? "read" : "written",
           static_cast<unsigned long long>(group_bytes_[i][static_cast<std::size_t>(d)].load(std::memory_order_relaxed)));
}

}  // namespace kvtd::metrics
