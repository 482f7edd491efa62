// Per cache group figures in the Prometheus exposition: each group's host pool and the bytes
// swaps moved of its blocks, by group and kind; nothing of the kind for a single-shape cache;
// promtool accepts it.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "kvtd/metrics/registry.h"

namespace kvtd::metrics {
namespace {

TEST(GroupMetricsTest, EachGroupsPoolAndSwappedBytesAreLabelledByGroupAndKind) {
  MetricsRegistry reg;
  EXPECT_EQ(reg.render().find("kvtd_cache_group_"), std::string::npos);  // a single-shape cache
  reg.set_cache_groups({{"sliding_window", 4096}, {"state", 1 << 20}});
  reg.group_swap_bytes(0, Direction::kToHost, 300);
  reg.group_swap_bytes(1, Direction::kToDevice, 7);
  reg.group_swap_bytes(1, Direction::kStorageRead, 99);  // not a swap direction: ignored
  reg.group_swap_bytes(9, Direction::kToHost, 99);       // no such group: ignored
  reg.group_storage_bytes(1, Direction::kStorageWrite, 5);
  reg.group_storage_bytes(0, Direction::kToHost, 99);    // not a storage direction: ignored
  const std::string text = reg.render();
  for (const std::string want :
       {"kvtd_cache_group_host_pool_bytes{group=\"0\",kind=\"sliding_window\"} 4096\n",
        "kvtd_cache_group_host_pool_bytes{group=\"1\",kind=\"state\"} 1048576\n",
        "kvtd_cache_group_swap_bytes_total{group=\"0\",kind=\"sliding_window\",direction=\"to_host\"} 300\n",
        "kvtd_cache_group_swap_bytes_total{group=\"1\",kind=\"state\",direction=\"to_device\"} 7\n",
        "kvtd_cache_group_swap_bytes_total{group=\"1\",kind=\"state\",direction=\"to_host\"} 0\n",
        "kvtd_cache_group_swap_bytes_total{group=\"1\",kind=\"state\",direction=\"to_device\"} 7\n",
        "kvtd_cache_group_storage_bytes_total{group=\"1\",kind=\"state\",direction=\"written\"} 5\n",
        "kvtd_cache_group_storage_bytes_total{group=\"0\",kind=\"sliding_window\",direction=\"read\"} 0\n"})
    EXPECT_NE(text.find(want), std::string::npos) << want << text;
  EXPECT_EQ(reg.group_swap_bytes(1, Direction::kToDevice), 7u);
  EXPECT_EQ(reg.group_storage_bytes(1, Direction::kStorageWrite), 5u);
  EXPECT_EQ(reg.group_swap_bytes(1, Direction::kStorageRead), 0u);  // the storage counters stay apart
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) GTEST_SKIP() << "promtool is not installed";
  const std::string file = ::testing::TempDir() + "/group_metrics.prom";
  { std::ofstream(file) << text; }
  EXPECT_EQ(std::system(("promtool check metrics < " + file + " > " + file + ".out 2>&1").c_str()), 0)
      << (std::stringstream() << std::ifstream(file + ".out").rdbuf()).str();
  std::remove(file.c_str());
}

}  // namespace
}  // namespace kvtd::metrics
