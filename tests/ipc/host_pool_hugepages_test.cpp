// --host-pool-hugepages. The pool is a file in a hugetlbfs mount: it maps in
// 2 MiB pages, survives a daemon restart as the /dev/shm pool does, is refused by name when the
// kernel has too few free pages or the directory is not hugetlbfs, and a dead session's pool there
// is swept. Needs root (it mounts its own hugetlbfs and raises vm.nr_hugepages for the test,
// restoring both); skipped otherwise.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utime.h>

#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <string>

#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/ipc/shared_object.h"
#include "test_support.h"

namespace kvtd::daemon {
namespace {

namespace fs = std::filesystem;
constexpr const char* kNrHugepages = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
constexpr std::uint64_t kHuge = 2u << 20;

long read_long(const char* path) {
  std::ifstream f(path);
  long v = -1;
  f >> v;
  return f ? v : -1;
}

bool write_long(const char* path, long v) {
  std::ofstream f(path);
  f << v << "\n";
  f.flush();
  return static_cast<bool>(f);
}

// 2 layers x K/V x 8 blocks of 64 KiB: 2 MiB of blocks and a header, so 2 huge pages.
proto::CacheGeometry small_geometry(std::uint32_t host_blocks = 8) {
  proto::CacheGeometry g{};
  g.num_ranks = 1;
  g.num_layers = 2;
  g.dtype = static_cast<std::uint32_t>(proto::CacheDtype::kBFloat16);
  g.num_host_blocks = host_blocks;
  const std::int64_t shape[4] = {16, 8, 32, 128};  // 64 KiB per block
  std::copy(shape, shape + 4, g.key_shape);
  std::copy(shape, shape + 4, g.value_shape);
  return g;
}

class HostPoolHugePagesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root (a hugetlbfs mount and vm.nr_hugepages)";
    dir_ = fmt::format("{}/kvtd_huge_{}", ::testing::TempDir(), getpid());
    fs::create_directories(dir_);
    if (::mount("none", dir_.c_str(), "hugetlbfs", 0, "pagesize=2M") != 0) {
      fs::remove(dir_);
      GTEST_SKIP() << "cannot mount hugetlbfs here: " << std::strerror(errno);
    }
    mounted_ = true;
    nr_before_ = read_long(kNrHugepages);
    const std::int64_t have = ipc::free_huge_pages(kHuge);
    if (nr_before_ < 0 || have < 0) GTEST_SKIP() << "no 2 MiB huge pages on this kernel";
    if (have < 8 && (!write_long(kNrHugepages, nr_before_ + 8 - have) || ipc::free_huge_pages(kHuge) < 8))
      GTEST_SKIP() << "the kernel could not reserve 8 huge pages of 2 MiB";
    backend_ = make_host_backend();
  }
  void TearDown() override {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    if (!dir_.empty()) fs::remove(dir_);
    if (nr_before_ >= 0 && read_long(kNrHugepages) != nr_before_) write_long(kNrHugepages, nr_before_);
  }
  std::uint64_t generation() const { return 0x4e000000u + static_cast<std::uint64_t>(getpid()); }
  std::string file_of(std::uint32_t rank) const {
    return dir_ + "/" + ipc::session_object_name(generation(), fmt::format("host{}", rank));
  }

  std::string dir_;
  bool mounted_ = false;
  long nr_before_ = -1;
  std::unique_ptr<DeviceBackend> backend_;
};

TEST_F(HostPoolHugePagesTest, APoolInHugePagesSurvivesADaemonRestartAndGoesWithTheSession) {
  const auto g = small_geometry();
  const auto free_before = ipc::free_huge_pages(kHuge);
  {
    auto pool = HostPool::open(*backend_, g, generation(), 0, daemon::HostLayout::kLayerFirst, -1,
                               HostPool::PinPlan(), dir_);
    ASSERT_TRUE(pool.ok()) << pool.error().message;
    EXPECT_FALSE((*pool)->restored());
    EXPECT_EQ((*pool)->page_bytes(), kHuge);
    EXPECT_EQ(ipc::free_huge_pages(kHuge), free_before - 2) << "2 MiB of blocks and the header: 2 pages";
    std::byte* b3 = (*pool)->region(1, proto::TensorKind::kValue) + 3 * (*pool)->stride(proto::TensorKind::kValue);
    std::memset(b3, 0x5a, 65536);
    const std::int32_t id = 3;
    (*pool)->mark_valid(std::span(&id, 1));
  }  // the daemon exits (a crash, a restart): the file and its pages stay
  struct stat st {};
  ASSERT_EQ(::stat(file_of(0).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto again = HostPool::open(*backend_, g, generation(), 0, daemon::HostLayout::kLayerFirst, -1,
                              HostPool::PinPlan(), dir_);
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_TRUE((*again)->restored());
  EXPECT_EQ((*again)->valid_blocks(), 1u);
  const std::byte* b3 = (*again)->region(1, proto::TensorKind::kValue) + 3 * (*again)->stride(proto::TensorKind::kValue);
  EXPECT_EQ(b3[0], std::byte{0x5a});
  EXPECT_EQ(b3[65535], std::byte{0x5a});
  (*again)->remove();  // the session ended
  again->reset();
  EXPECT_FALSE(fs::exists(file_of(0)));
  EXPECT_EQ(ipc::free_huge_pages(kHuge), free_before);
}

TEST_F(HostPoolHugePagesTest, TooFewFreeHugePagesIsRefusedNamingTheCounts) {
  const std::int64_t have = ipc::free_huge_pages(kHuge);
  // Blocks of 64 KiB x 4 tensors: 8 blocks a page; one page more than the kernel has free.
  const auto blocks = static_cast<std::uint32_t>((have + 1) * 8);
  auto pool = HostPool::open(*backend_, small_geometry(blocks), generation() + 1, 0, daemon::HostLayout::kLayerFirst,
                             -1, HostPool::PinPlan(), dir_);
  ASSERT_FALSE(pool.ok());
  const std::string& why = pool.error().message;
  EXPECT_NE(why.find("--host-pool-hugepages"), std::string::npos) << why;
  EXPECT_NE(why.find("pages of 2048 kB"), std::string::npos) << why;
  EXPECT_NE(why.find(fmt::format("the kernel has {} free", have)), std::string::npos) << why;
  EXPECT_NE(why.find("vm.nr_hugepages"), std::string::npos) << why;
  EXPECT_FALSE(fs::exists(file_of(0)));
}

TEST_F(HostPoolHugePagesTest, ADirectoryThatIsNotHugetlbfsIsRefusedByName) {
  const std::string plain = ::testing::TempDir();
  auto pool = HostPool::open(*backend_, small_geometry(), generation() + 2, 0, daemon::HostLayout::kLayerFirst, -1,
                             HostPool::PinPlan(), plain);
  ASSERT_FALSE(pool.ok());
  EXPECT_NE(pool.error().message.find("is not a hugetlbfs mount"), std::string::npos) << pool.error().message;
  EXPECT_NE(pool.error().message.find("--hugetlbfs-dir"), std::string::npos) << pool.error().message;
}

TEST_F(HostPoolHugePagesTest, ADeadSessionsPoolInTheMountIsSwept) {
  // A session that no longer exists (no segment names its generation) left its pool here, and
  // the daemon that held it is gone too (a live holder keeps it: host_tier_adoption_test).
  const std::uint64_t gen = generation() + 3;  // of this process's pid, not the child's
  ASSERT_TRUE(test::in_dead_child([&] {
    return HostPool::open(*backend_, small_geometry(), gen, 0, daemon::HostLayout::kLayerFirst, -1, HostPool::PinPlan(),
                          dir_)
        .ok();
  }));
  const std::string file = dir_ + "/" + ipc::session_object_name(gen, "host0");
  ASSERT_TRUE(fs::exists(file));
  // Fresh objects are never swept (another engine may be creating its session): age it.
  const utimbuf old{time(nullptr) - 120, time(nullptr) - 120};
  ASSERT_EQ(::utime(file.c_str(), &old), 0);
  const auto removed = ipc::sweep_stale_objects({dir_});
  EXPECT_NE(std::find(removed.begin(), removed.end(), file), removed.end());
  EXPECT_FALSE(fs::exists(file));
}

}  // namespace
}  // namespace kvtd::daemon
