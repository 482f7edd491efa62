#include "kvtd/daemon/numa.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <numa.h>
#include <numaif.h>
#include <sched.h>
#include <sys/mman.h>

#include <atomic>
#include <thread>
#include <vector>

namespace kvtd::daemon {
namespace {

// The daemon's storage workers bind at the same moment; libnuma's lazily built node table made
// that a data race (ThreadSanitizer). First in this file, so libnuma has not built it yet.
TEST(Numa, ThreadsBindingAtOnceDoNotRaceInLibnuma) {
  if (numa_available() < 0) GTEST_SKIP() << "libnuma reports no NUMA support here";
  std::vector<std::thread> threads;
  std::atomic<int> bound{0};
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&] {
      std::string why;
      if (bind_this_thread_to_numa_node(0, &why)) bound.fetch_add(1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(bound.load(), 8);
}

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

// Where the PCI tree is not visible (some containers), the NVIDIA driver's class directory
// still links each GPU to its PCI device: found by bus id (any spelling), else by ordinal.
TEST(Numa, FallsBackToTheNvidiaGpuClassDirectory) {
  namespace fs = std::filesystem;
  const auto root = fs::path(::testing::TempDir()) / "kvtd_fake_sysfs_nv";
  fs::remove_all(root);
  const auto pci = root / "devices/pci0000:3a/0000:3b:00.0";
  fs::create_directories(pci);
  std::ofstream(pci / "numa_node") << "1\n";
  fs::create_directories(root / "class/nvidia-gpu/nvidia3");
  fs::create_symlink(pci, root / "class/nvidia-gpu/nvidia3/device");
  std::string how;
  EXPECT_EQ(numa_node_of_pci_device("0000:3B:00.0", root.string()), -1);  // no bus/pci here
  EXPECT_EQ(numa_node_of_gpu("0000:3B:00.0", 0, root.string(), &how), 1);
  EXPECT_NE(how.find("nvidia3"), std::string::npos) << how;
  EXPECT_EQ(numa_node_of_gpu("00000000:3B:00.0", 0, root.string()), 1);  // NVML's 8-digit domain
  EXPECT_EQ(numa_node_of_gpu("", 3, root.string()), 1);                   // no bus id: by ordinal
  EXPECT_EQ(numa_node_of_gpu("0000:AA:00.0", 5, root.string()), -1);
  // The PCI path wins when it answers.
  fs::create_directories(root / "bus/pci/devices/0000:3b:00.0");
  std::ofstream(root / "bus/pci/devices/0000:3b:00.0/numa_node") << "0\n";
  EXPECT_EQ(numa_node_of_gpu("00000000:3b:00.0", 3, root.string(), &how), 0);
  EXPECT_NE(how.find("bus/pci"), std::string::npos) << how;
  fs::remove_all(root);
}

TEST(Numa, ACopyThreadBoundToANodeRunsOnlyOnItsCpus) {
  if (numa_available() < 0) GTEST_SKIP() << "libnuma reports no NUMA support here";
  std::string why;
  EXPECT_FALSE(bind_this_thread_to_numa_node(4096, &why));
  EXPECT_FALSE(why.empty());
  cpu_set_t before, after;
  ASSERT_EQ(sched_getaffinity(0, sizeof before, &before), 0);
  std::thread t([&] {
    ASSERT_TRUE(bind_this_thread_to_numa_node(0, &why)) << why;
    ASSERT_EQ(sched_getaffinity(0, sizeof after, &after), 0);
  });
  t.join();
  struct bitmask* cpus = numa_allocate_cpumask();
  ASSERT_EQ(numa_node_to_cpus(0, cpus), 0);
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    const bool want = c < static_cast<int>(cpus->size) && numa_bitmask_isbitset(cpus, static_cast<unsigned>(c)) &&
                      CPU_ISSET(c, &before);
    EXPECT_EQ(CPU_ISSET(c, &after) != 0, want) << "cpu " << c;
  }
  numa_free_cpumask(cpus);
  // Only that thread moved: this one keeps its affinity.
  cpu_set_t mine;
  ASSERT_EQ(sched_getaffinity(0, sizeof mine, &mine), 0);
  EXPECT_TRUE(CPU_EQUAL(&mine, &before));
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
