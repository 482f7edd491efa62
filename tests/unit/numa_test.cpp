#include "kvtd/daemon/numa.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
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
  why.clear();
  if (bind_to_numa_node(p, bytes, 0, &why)) {
    static_cast<char*>(p)[0] = 1;  // memory stays usable
  } else {
    EXPECT_FALSE(why.empty());
  }
  munmap(p, bytes);
}

}  // namespace
}  // namespace kvtd::daemon
