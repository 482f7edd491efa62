// The sweep of what dead engines left in /dev/shm (ipc::sweep_stale_objects) against engines that
// come and go while it runs.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cstring>
#include <ctime>
#include <cstdlib>
#include <optional>

#include "kvtd/engine/engine_session.h"
#include "kvtd/ipc/liveness_lock.h"
#include "kvtd/ipc/segment.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/proto/names.h"
#include "test_support.h"

namespace kvtd {
namespace {

std::unique_ptr<engine::EngineSession> engine_of(const std::string& suffix) {
  engine::SessionOptions o;
  o.suffix = suffix;
  o.geometry = test::small_geometry(1);
  auto s = engine::EngineSession::create(o);
  EXPECT_TRUE(s.ok()) << s.error().message;
  return s.ok() ? std::move(s).value() : nullptr;
}

// The flake of CudaDaemonTest.AnEngineKilledWithItsEventPendingNeverWedgesTheDaemon (trust round
// 4): another test's sweep judged a killed engine's session dead; before it removed it, the next
// engine of that suffix removed the dead segment and made its own under the name; the sweep then
// removed by name, unlinking the live session, and its daemon waited for it "to appear" until the
// engine's wait_ready timed out. Here the next engine takes the name right between the sweep's
// judging and its removal: its session must survive. Fails on the old sweep.
TEST(StaleSessions, ASweepNeverRemovesTheLiveSessionThatTookADeadOnesName) {
  test::Watchdog dog(60);
  const auto suffix = test::unique_suffix("sweep_race");
  const std::string name = ipc::detail::session_name(suffix);
  const pid_t child = fork();
  if (child == 0) {  // an engine that dies without closing its session
    auto dying = engine_of(suffix);
    _exit(dying ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::unique_ptr<engine::EngineSession> next;
  bool judged = false;
  // Other tests' sessions mid-creation make a sweep stop before judging: sweep until ours judged.
  EXPECT_TRUE(test::eventually([&] {
    (void)ipc::detail::sweep_stale_objects_judged({}, [&] {
      judged = true;
      next = engine_of(suffix);  // removes the dead segment itself, then creates its own
    });
    return judged;
  }, std::chrono::seconds(20)));
  ASSERT_TRUE(next);
  auto seen = ipc::SharedObject::open(name);
  ASSERT_TRUE(seen.ok()) << "the live session's name was removed by the sweep";
  const auto* h = reinterpret_cast<const proto::SessionHeader*>((*seen)->data());
  EXPECT_EQ(h->generation, next->generation());
  EXPECT_EQ(h->creator_pid, static_cast<std::uint32_t>(getpid()));
}

// What a sweep judged dead and nobody replaced is still removed (by the move aside and check).
TEST(StaleSessions, ADeadSessionNobodyReplacedIsRemoved) {
  test::Watchdog dog(60);
  const auto suffix = test::unique_suffix("sweep_dead");
  const std::string name = ipc::detail::session_name(suffix);
  const pid_t child = fork();
  if (child == 0) {
    auto dying = engine_of(suffix);
    _exit(dying ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(ipc::SharedObject::open(name).ok());
  EXPECT_TRUE(test::eventually([&] {
    (void)ipc::sweep_stale_objects();
    return !ipc::SharedObject::open(name).ok();
  }, std::chrono::seconds(20)));
}

// An engine's liveness lock went with its open file description into every child it forked
// (Python's multiprocessing "fork"): a live child of a killed engine kept the session "alive", so
// the restarted engine was refused and nothing of it was swept. The child's copy is dropped at
// fork now. Fails without the fork handler in ipc/src/liveness_lock.cpp.
TEST(StaleSessions, AForkedChildNeverKeepsADeadEnginesSessionAlive) {
  test::Watchdog dog(60);
  const auto suffix = test::unique_suffix("fork_child");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t engine = fork();
  if (engine == 0) {
    close(ready[0]);
    auto s = engine_of(suffix);
    if (!s) _exit(1);
    const pid_t child = fork();  // outlives the engine
    if (child == 0) {
      // Says so only here: the fork handler runs in the child, after the parent may have gone on
      // (the engine saying it made the child was seen before the child dropped its copy).
      const std::string said = std::to_string(getpid());
      if (write(ready[1], said.data(), said.size()) <= 0) _exit(1);
      ::sleep(30);
      _exit(0);
    }
    _exit(0);  // dies without closing its session
  }
  close(ready[1]);
  char buf[32] = {};
  ASSERT_GT(read(ready[0], buf, sizeof buf - 1), 0);
  close(ready[0]);
  const pid_t child = static_cast<pid_t>(std::atoi(buf));
  int status = 0;
  ASSERT_EQ(waitpid(engine, &status, 0), engine);
  ASSERT_EQ(kill(child, 0), 0) << "the engine's child still runs";
  auto restarted = engine_of(suffix);
  EXPECT_TRUE(restarted) << "the dead engine's child kept its session alive";
  kill(child, SIGKILL);
}

// Trust round 4: the host pool a daemon keeps for its engine's restart was judged by its holder's
// pid alone, so a sweep in another pid namespace (where that pid is nobody, or someone else)
// removed a live daemon's pool. The holder's lock on the pool (ipc::kPoolHolderLockByte) now says
// it lives, seen from any namespace. Here the header names a holder that is nobody, as a daemon of
// another namespace is, and the lock is held: the sweep keeps the pool; once the lock goes, it is
// removed (the sweep did judge it). Fails on the pid-only judgment.
TEST(StaleSessions, APoolWhoseHolderLivesInAnotherPidNamespaceIsNotSwept) {
  test::Watchdog dog(60);
  const std::string name = ipc::session_object_name(0x7e57000000000000ull | static_cast<std::uint64_t>(getpid()), "host0");
  auto pool = ipc::SharedObject::create(name, 4096);
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  proto::HostPoolPrefix prefix{};
  prefix.magic = proto::kHostPoolMagic;
  prefix.holder = proto::owner_word(static_cast<std::uint32_t>(gone), 1);  // nobody here
  std::memcpy((*pool)->data(), &prefix, sizeof prefix);
  const struct timespec old[2] = {{time(nullptr) - 120, 0}, {time(nullptr) - 120, 0}};  // past the 30 s grace
  ASSERT_EQ(utimensat(AT_FDCWD, ("/dev/shm/" + name).c_str(), old, 0), 0);
  auto lock = ipc::LivenessLock::take(name, (*pool)->inode(), ipc::kPoolHolderLockByte);
  ASSERT_TRUE(lock.ok()) << lock.error().message;
  bool judged = false;
  EXPECT_TRUE(test::eventually([&] {
    (void)ipc::detail::sweep_stale_objects_judged({}, [&] { judged = true; });
    return judged;
  }, std::chrono::seconds(20)));
  EXPECT_TRUE(ipc::SharedObject::open(name).ok()) << "the sweep removed a pool whose holder holds its lock";
  lock = ipc::LivenessLock();  // the holder exits
  EXPECT_TRUE(test::eventually([&] {
    (void)ipc::sweep_stale_objects();
    return !ipc::SharedObject::open(name).ok();
  }, std::chrono::seconds(20)));
  ipc::SharedObject::remove(name);
}

// Trust round 4: /dev/shm is world-writable and a session's name predictable; another user who
// made kvtd_<uid>_<suffix> first stopped a non-root engine with "already exists", naming nobody.
// The engine (uid 65534 here) now names the squatter's uid. Needs root to play both users.
TEST(StaleSessions, ASessionNameAnotherUserTookIsRefusedNamingThatUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run as two other users";
  test::Watchdog dog(60);
  const auto suffix = test::unique_suffix("squat");
  const std::string name = "kvtd_65534_" + suffix;  // the engine's name, as uid 65534 makes it
  const pid_t squatter = fork();
  if (squatter == 0) {
    if (setgid(65533) != 0 || setuid(65533) != 0) _exit(2);
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    _exit(fd >= 0 && ftruncate(fd, 4096) == 0 ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(waitpid(squatter, &status, 0), squatter);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << WEXITSTATUS(status);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t engine = fork();
  if (engine == 0) {
    close(pipe_fds[0]);
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    engine::SessionOptions o;
    o.suffix = suffix;
    o.geometry = test::small_geometry(1);
    auto s = engine::EngineSession::create(o);
    const std::string said = s.ok() ? "created" : s.error().message;
    _exit(write(pipe_fds[1], said.data(), said.size()) > 0 ? 0 : 4);
  }
  close(pipe_fds[1]);
  char buf[1024] = {};
  const ssize_t got = read(pipe_fds[0], buf, sizeof buf - 1);
  close(pipe_fds[0]);
  ASSERT_EQ(waitpid(engine, &status, 0), engine);
  shm_unlink(name.c_str());
  ASSERT_GT(got, 0);
  EXPECT_NE(std::string(buf).find("belongs to uid 65533 (another user made it first"), std::string::npos) << buf;
}

}  // namespace
}  // namespace kvtd
