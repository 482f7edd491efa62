// SharedObject::create when the system refuses a step. fchmod is interposed in this test binary
// (the executable's definition wins over libc's for the statically linked kvtd_ipc), and fails
// while `g_fail_fchmod` is set; otherwise it is the real system call.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>

#include "kvtd/ipc/shared_object.h"
#include "test_support.h"

namespace {
std::atomic<bool> g_fail_fchmod{false};
}  // namespace

extern "C" int fchmod(int fd, mode_t mode) {
  if (g_fail_fchmod.load()) {
    errno = EPERM;
    return -1;
  }
  return static_cast<int>(syscall(SYS_fchmod, fd, mode));
}

namespace kvtd::ipc {
namespace {

// fchmod's result was ignored: a segment whose mode could not be narrowed to 0600 (so possibly
// readable by others, per the umask) was used anyway.
TEST(SharedObjectFault, AModeThatCannotBeSetFailsCreateAndLeavesNothing) {
  const auto name = test::unique_suffix("fchmod");
  SharedObject::remove(name);  // a killed earlier run of this pid's number may have left it
  g_fail_fchmod.store(true);
  auto o = SharedObject::create(name, 4096);
  g_fail_fchmod.store(false);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error().code, IpcErrc::kSystem);
  EXPECT_NE(o.error().message.find("set the mode of " + name), std::string::npos) << o.error().message;
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  EXPECT_LT(fd, 0) << name << " was left behind";
  if (fd >= 0) {
    close(fd);
    shm_unlink(name.c_str());
  }
  auto again = SharedObject::create(name, 4096);  // and the real call works
  ASSERT_TRUE(again.ok()) << again.error().message;
  SharedObject::remove(name);  // objects outlive their handles by design; this one is the test's
}

}  // namespace
}  // namespace kvtd::ipc
