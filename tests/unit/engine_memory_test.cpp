// The host backend's "device" tensors in memory an engine made without a name: sglang's host pool
// with "allocator": "shm" is a memfd (mem_cache/storage/mmap/mmap_allocator.py:160-167 at v0.5.18),
// which the engine names by its /proc/<pid>/fd/<fd> path. Nothing but that exact form is opened
// that way, and only a non-empty regular file is mapped.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "kvtd/daemon/device_backend.h"

namespace kvtd::daemon {
namespace {

proto::TensorDesc desc(const std::string& name, std::uint64_t offset, std::uint64_t bytes) {
  proto::TensorDesc d{};
  std::memcpy(d.handle, name.data(), std::min(name.size(), sizeof d.handle));
  d.offset = offset;
  d.bytes = bytes;
  d.device_id = -1;
  return d;
}

class EngineMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    fd_ = memfd_create("kvtd_engine_memory_test", MFD_CLOEXEC);
    ASSERT_GE(fd_, 0);
    ASSERT_EQ(ftruncate(fd_, 1 << 16), 0);
    auto* p = static_cast<std::uint8_t*>(mmap(nullptr, 1 << 16, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
    ASSERT_NE(p, MAP_FAILED);
    for (int i = 0; i < (1 << 16); ++i) p[i] = static_cast<std::uint8_t>(i * 7);
    mine_ = p;
  }
  void TearDown() override {
    if (mine_) munmap(mine_, 1 << 16);
    if (fd_ >= 0) close(fd_);
  }
  std::string path() const { return fmt::format("/proc/{}/fd/{}", getpid(), fd_); }
  int fd_ = -1;
  std::uint8_t* mine_ = nullptr;
};

TEST_F(EngineMemory, AMemfdNamedByItsProcPathIsTheEnginesOwnPages) {
  auto b = make_host_backend();
  auto t = b->open_tensor(desc(path(), 4096, 8192));
  ASSERT_TRUE(t.ok()) << t.error().message;
  auto* seen = reinterpret_cast<std::uint8_t*>(*t);
  EXPECT_EQ(seen[0], static_cast<std::uint8_t>(4096 * 7));
  seen[1] = 0xAB;  // the daemon's writes are the engine's bytes: no copy in between
  EXPECT_EQ(mine_[4097], 0xAB);
}

TEST_F(EngineMemory, ATensorPastTheEndOfTheMemfdIsRefusedNamingTheSizes) {
  auto b = make_host_backend();
  auto t = b->open_tensor(desc(path(), 60000, 8192));
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("exceeds object"), std::string::npos) << t.error().message;
  EXPECT_NE(t.error().message.find("65536 bytes"), std::string::npos) << t.error().message;
}

TEST_F(EngineMemory, OnlyTheExactProcFdFormIsOpenedAndOnlyARegularFile) {
  auto b = make_host_backend();
  const std::string pid = std::to_string(getpid());
  for (const std::string& bad : {fmt::format("/proc/self/fd/{}", fd_), "/proc/" + pid + "/fd/",
                                "/proc/" + pid + "/fd/3x", "/proc/" + pid + "/environ",
                                fmt::format("/proc/{}/fd/../fd/{}", pid, fd_)}) {
    auto t = b->open_tensor(desc(bad, 0, 16));
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_NE(t.error().message.find("/proc/<pid>/fd/<fd>"), std::string::npos) << bad << ": " << t.error().message;
  }
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  auto t = b->open_tensor(desc(fmt::format("/proc/{}/fd/{}", pid, pipe_fds[0]), 0, 16));
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("not a non-empty memfd"), std::string::npos) << t.error().message;
  auto gone = b->open_tensor(desc("/proc/" + pid + "/fd/999999", 0, 16));
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.error().message.find("cannot take it from the engine"), std::string::npos) << gone.error().message;
}

// Trust round 4: the daemon reopened /proc/<pid>/fd/<fd> with its own rights. It now takes the
// engine's descriptor itself (pidfd_getfd), so the engine's access mode comes with it, and maps
// only a memfd: a tmpfs file the engine holds read-write (someone's /dev/shm object) is refused.
TEST_F(EngineMemory, TheEnginesDescriptorIsTakenWithItsModeAndOnlyAMemfdIsMapped) {
  auto b = make_host_backend();
  const std::string pid = std::to_string(getpid());
  const int read_only = open(fmt::format("/proc/self/fd/{}", fd_).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(read_only, 0);
  auto t = b->open_tensor(desc(fmt::format("/proc/{}/fd/{}", pid, read_only), 0, 16));
  close(read_only);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message.find("is open read-only in the engine"), std::string::npos) << t.error().message;

  const std::string shm = "/dev/shm/kvtd_engine_memory_test_" + pid;
  const int tmpfs = open(shm.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  ASSERT_GE(tmpfs, 0);
  unlink(shm.c_str());
  ASSERT_EQ(ftruncate(tmpfs, 4096), 0);
  auto u = b->open_tensor(desc(fmt::format("/proc/{}/fd/{}", pid, tmpfs), 0, 16));
  close(tmpfs);
  ASSERT_FALSE(u.ok());
  EXPECT_NE(u.error().message.find("is not shared memory the engine made (a memfd)"), std::string::npos)
      << u.error().message;
}

}  // namespace
}  // namespace kvtd::daemon
