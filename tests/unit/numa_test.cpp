#include "kvtd/daemon/numa.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>

namespace kvtd::daemon {
namespace {

TEST(Numa, ReadsTheNodeOfAPciDeviceFromSysfs) {
  const auto root = std::filesystem::path(::testing::TempDir()) / "kvtd_fake_sysfs";
  std::filesystem::remove_all(root);
  const auto dev = root / "bus/pci/devices/0000:3b:00.0";
  std::filesystem::create_directories(dev);
  std::ofstream(dev / "numa_node") << "1\n";
  EXPECT_EQ(numa_node_of_pci_device("0000:3B:00.0", root.string()), 1);  // CUDA's upper case
  std::ofstream(dev / "numa_node") << "-1\n";
  EXPECT_EQ(numa_node_of_pci_device("0000:3B:00.0", root.string()), -1);
  EXPECT_EQ(numa_node_of_pci_device("0000:AA:00.0", root.string()), -1);
  std::filesystem::remove_all(root);
}

TEST(Numa, BindingToANodeThatDoesNotExistSaysSo) {
  const std::size_t bytes = 1 << 20;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::string why;
  EXPECT_FALSE(bind_to_numa_node(p, bytes, 4096, &why));
  EXPECT_FALSE(why.empty());
  munmap(p, bytes);
}

// Where NUMA is supported, a bind to node 0 (every machine has it) must succeed and the pages
// must then really be on node 0; without NUMA support the test says it skipped, not passed.
TEST(Numa, BoundMemoryIsOnTheRequestedNode) {
  if (numa_available() < 0) GTEST_SKIP() << "libnuma reports no NUMA support here";
  const std::size_t bytes = 1 << 20;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::string why;
  ASSERT_TRUE(bind_to_numa_node(p, bytes, 0, &why)) << why;
  static_cast<volatile char*>(p)[4096] = 1;  // fault a page in under the policy
  int node = -1;
  ASSERT_EQ(get_mempolicy(&node, nullptr, 0, static_cast<char*>(p) + 4096, MPOL_F_NODE | MPOL_F_ADDR), 0);
  EXPECT_EQ(node, 0);
  munmap(p, bytes);
}

}  // namespace
}  // namespace kvtd::daemon
