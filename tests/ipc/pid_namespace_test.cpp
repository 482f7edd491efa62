// Engine and daemon in two pid namespaces, as two containers of one pod by default (trust round
// 4): each daemon runs under `unshare --pid --fork --mount-proc`, so its pids (it is pid 1 there)
// name nobody, or someone else, in the engine's namespace. Liveness and fencing go by the
// processes' locks on the session segment (ipc/liveness_lock.h), never a foreign pid. Needs root
// (unshare); skipped without it. Each case fails on the pid-based code.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "daemon_fixture.h"
#include "kvtd/ipc/liveness_lock.h"
#include "kvtd/ipc/segment.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/proto/names.h"

namespace kvtd {
namespace {

// The pid (in this namespace) of `parent`'s first child, or -1 within `timeout`.
pid_t child_of(pid_t parent, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (DIR* d = opendir("/proc")) {
      while (dirent* e = readdir(d)) {
        const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
        if (pid <= 0) continue;
        std::ifstream stat("/proc/" + std::string(e->d_name) + "/stat");
        std::string line;
        std::getline(stat, line);
        const auto close_paren = line.rfind(')');
        if (close_paren == std::string::npos) continue;
        std::istringstream rest(line.substr(close_paren + 2));
        char state = 0;
        pid_t ppid = 0;
        rest >> state >> ppid;
        if (ppid == parent) {
          closedir(d);
          return pid;
        }
      }
      closedir(d);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

class PidNamespaceTest : public DaemonTest {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "unshare --pid needs root";
    if (std::system("unshare --pid --fork --mount-proc true >/dev/null 2>&1") != 0)
      GTEST_SKIP() << "unshare --pid --fork --mount-proc does not work here";
  }

  // Rank `rank`'s daemon in a pid namespace of its own (and a mount namespace for its /proc;
  // /dev/shm is the same tmpfs). It dies with the unshare process.
  Child start_daemon_apart(std::uint32_t rank, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv{"/usr/bin/unshare", "--pid", "--fork", "--mount-proc", "--kill-child"};
    for (auto& a : daemon_args(rank, g_)) argv.push_back(a);
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Child(argv, log_path(rank));
  }
};

// Before: the engine fenced the silent daemon by its pid (1 in its namespace): pid 1 here is
// another process, whose start time did not match, so the fence said "process 1 had exited",
// the engine failed the load rank_dead and reused its blocks, and after SIGCONT the daemon's copy
// finished into them. Now the daemon still holds its lock: it cannot be signalled from here, so
// the engine says rank_unfenced (its blocks kept out of use).
TEST_F(PidNamespaceTest, ADaemonStoppedInAnotherPidNamespaceIsUnfencedNeverDead) {
  g_ = test::small_geometry(1);
  daemons_.push_back(start_daemon_apart(0));
  ASSERT_NO_FATAL_FAILURE(start_engine(1u << 16, 1'000'000'000));
  ASSERT_TRUE(engine_->wait_ready(20'000'000'000).ok()) << test::read_file(log_path(0));
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2}, {3, 4}).ok());
  // Its host pool says it has a live holder to a sweep of any namespace (stale_sessions_test).
  const std::string pool = ipc::session_object_name(engine_->generation(), proto::host_pool_object(0, 0));
  auto mapped = ipc::SharedObject::open(pool);
  ASSERT_TRUE(mapped.ok()) << mapped.error().message;
  EXPECT_EQ(ipc::lock_holder(pool, (*mapped)->inode(), ipc::kPoolHolderLockByte), ipc::LockHolder::kHeld);
  const pid_t daemon = child_of(daemons_[0].pid(), std::chrono::seconds(5));
  ASSERT_GT(daemon, 0);
  ASSERT_EQ(kill(daemon, SIGSTOP), 0);
  const auto r = run(TaskKind::kSwapToDevice, {3, 4}, {9, 10});
  EXPECT_EQ(r.status, TaskStatus::kRankUnfenced) << (r.failures.empty() ? "" : r.failures[0].message);
  ASSERT_FALSE(r.failures.empty());
  EXPECT_NE(r.failures[0].message.find("another pid namespace"), std::string::npos) << r.failures[0].message;
  kill(daemon, SIGCONT);
}

// A daemon of another namespace that exits is seen gone by its released lock (its pid, 1 there,
// is alive here: the old check never saw it exit before the heartbeat timed out), and its tasks
// fail rank_dead.
TEST_F(PidNamespaceTest, ADaemonKilledInAnotherPidNamespaceIsDeadByItsReleasedLock) {
  g_ = test::small_geometry(1);
  daemons_.push_back(start_daemon_apart(0));
  ASSERT_NO_FATAL_FAILURE(start_engine(1u << 16, 3'000'000'000));
  ASSERT_TRUE(engine_->wait_ready(20'000'000'000).ok()) << test::read_file(log_path(0));
  const pid_t daemon = child_of(daemons_[0].pid(), std::chrono::seconds(5));
  ASSERT_GT(daemon, 0);
  ASSERT_EQ(kill(daemon, SIGSTOP), 0);  // no report, no heartbeat: only the lock can tell
  const std::uint64_t id = submit(TaskKind::kSwapToHost, {1}, {2});
  ASSERT_EQ(kill(daemon, SIGKILL), 0);
  const auto started = std::chrono::steady_clock::now();
  auto r = engine_->wait(id, 20'000'000'000);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->status, TaskStatus::kRankDead) << (r->failures.empty() ? "" : r->failures[0].message);
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(2500))
      << "seen by the lock, before the 3 s heartbeat timeout";
}

// Before: a daemon starting in a third namespace swept the live engine's session (its creator's
// pid names nobody there) at start-up; the serving daemon then never found its session again.
TEST_F(PidNamespaceTest, ADaemonStartingInAnotherPidNamespaceSweepsNoLiveSession) {
  g_ = test::small_geometry(1);
  ASSERT_NO_FATAL_FAILURE(start_engine());
  const std::string name = ipc::detail::session_name(suffix_);
  for (auto* e : {&name}) ASSERT_TRUE(ipc::SharedObject::open(*e).ok());
  // Another deployment's daemon: it sweeps at start, waits 1 s for its own session, and exits.
  const std::string other = suffix_ + "x";
  std::vector<std::string> argv{"/usr/bin/unshare", "--pid", "--fork", "--mount-proc", "--kill-child"};
  for (auto& a : daemon_args(0, g_)) argv.push_back(a == suffix_ ? other : a);
  argv.insert(argv.end(), {"--attach-timeout", "1"});
  Child sweeper(argv, log_path(5));
  EXPECT_NE(sweeper.wait_exit(std::chrono::seconds(30)), -1);
  EXPECT_TRUE(ipc::SharedObject::open(name).ok()) << "the live engine's session was swept\n"
                                                  << test::read_file(log_path(5));
  EXPECT_TRUE(ipc::SharedObject::open(ipc::session_object_name(engine_->generation(), "dev0")).ok())
      << "its device arena was swept";
}

// Before: an engine restarted in place (a container gets the same small pid again) found its old
// segment "owned by live process <its own pid>" and could not make its session until someone
// deleted the segment by hand. The dead engine's lock is released: the segment is stale.
TEST(PidReuse, AnEngineRestartedWithItsOldPidMakesItsSession) {
  test::Watchdog dog(60);
  const auto suffix = test::unique_suffix("same_pid");
  const pid_t child = fork();
  if (child == 0) {  // the engine before its restart: dies without closing its session
    engine::SessionOptions o;
    o.suffix = suffix;
    o.geometry = test::small_geometry(1);
    auto s = EngineSession::create(o);
    _exit(s.ok() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // Its pid, as the restarted engine (this process) has it.
  auto old = ipc::SharedObject::open(ipc::detail::session_name(suffix));
  ASSERT_TRUE(old.ok());
  reinterpret_cast<proto::SessionHeader*>((*old)->data())->creator_pid = static_cast<std::uint32_t>(getpid());
  engine::SessionOptions o;
  o.suffix = suffix;
  o.geometry = test::small_geometry(1);
  auto s = EngineSession::create(o);
  ASSERT_TRUE(s.ok()) << s.error().message;
}

}  // namespace
}  // namespace kvtd
