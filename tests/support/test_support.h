// test_support.h - helpers shared by kvtd tests: child processes that die with the test,
// a watchdog that fails a hung test, small geometries, and polling with a deadline.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <string>
#include <string>
#include <thread>
#include <vector>

#include "kvtd/proto/geometry.h"

namespace kvtd::test {

// Aborts the whole test binary (and, through PDEATHSIG, its children) if it runs too long.
class Watchdog {
 public:
  explicit Watchdog(int seconds) { alarm(static_cast<unsigned>(seconds)); }
  ~Watchdog() { alarm(0); }
};

// A child process started with fork/exec. It receives SIGKILL if the test process dies, and is
// killed and reaped on destruction if still running.
class Child {
 public:
  Child() = default;
  // Fork-safe in a threaded parent (the engine session runs threads): everything the child
  // needs is prepared before fork, and the child calls only async-signal-safe functions
  // (no malloc, no stdio) until exec.
  Child(const std::vector<std::string>& argv, const std::string& log_path) {
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const char* log = log_path.empty() ? nullptr : log_path.c_str();
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (log != nullptr) {
        const int fd = ::open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
          dup2(fd, STDERR_FILENO);
          dup2(fd, STDOUT_FILENO);
        }
      }
      execv(args[0], args.data());
      _exit(127);
    }
  }
  Child(Child&& o) noexcept : pid_(o.pid_), status_(o.status_), reaped_(o.reaped_) { o.pid_ = -1; }
  Child& operator=(Child&& o) noexcept {
    std::swap(pid_, o.pid_);
    std::swap(status_, o.status_);
    std::swap(reaped_, o.reaped_);
    return *this;
  }
  ~Child() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  void signal(int sig) const { kill(pid_, sig); }

  // Waits up to `timeout` for exit; returns the exit code, 128+signal, or -1 on timeout.
  int wait_exit(std::chrono::milliseconds timeout) {
    if (reaped_) return code();
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      const pid_t r = waitpid(pid_, &status_, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        return code();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return -1;
  }
  bool running() {
    if (reaped_) return false;
    const pid_t r = waitpid(pid_, &status_, WNOHANG);
    if (r == pid_) reaped_ = true;
    return !reaped_;
  }

 private:
  int code() const { return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_); }
  pid_t pid_ = -1;
  int status_ = 0;
  bool reaped_ = false;
};

inline bool eventually(const std::function<bool()>& cond, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return cond();
}

// A TCP port free on loopback right now (the kernel's choice, released for the caller): a fixed
// or pid-derived port collides with other tests running beside this one.
inline std::uint16_t free_tcp_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  (void)::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  (void)::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

inline std::string read_file(const std::string& path) {
  std::string out;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    std::size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    std::fclose(f);
  }
  return out;
}

// Dates /dev/shm/<name> an hour back: the sweep spares objects touched in the last 30 s (they
// may belong to a session mid-creation), so a test's orphan must look old. False on failure.
inline bool make_hour_old(const std::string& shm_name) {
  const timespec hour_ago[2] = {{time(nullptr) - 3600, 0}, {time(nullptr) - 3600, 0}};
  return utimensat(AT_FDCWD, ("/dev/shm/" + shm_name).c_str(), hour_ago, 0) == 0;
}

// Runs `body` in a forked child that exits as soon as it returns (_exit: nothing the parent owns
// is torn down twice); true when it returned true. What the child made names a dead process: a
// host pool made there has a dead holder, as a SIGKILLed daemon's has.
inline bool in_dead_child(const std::function<bool()>& body) {
  const pid_t child = fork();
  if (child == 0) _exit(body() ? 0 : 1);
  int status = 0;
  return child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// "t<pid>_<name>", cut to the 64-character suffix limit (with a hash of the full name, so two
// long names that share a prefix stay distinct): test names once pushed it over with 5-digit pids.
inline std::string unique_suffix(const std::string& name) {
  // Built by appending: GCC 12 at -O3 reports a false -Wrestrict for "literal" + std::string&&
  // (GCC bug 105651), which broke -DCMAKE_BUILD_TYPE=Release with warnings as errors.
  std::string s = "t";
  s += std::to_string(getpid());
  s += '_';
  s += name;
  if (s.size() <= 64) return s;
  char tail[10];
  std::snprintf(tail, sizeof tail, "_%08zx", std::hash<std::string>{}(name) & 0xffffffffu);
  return s.substr(0, 64 - 9) + tail;
}

inline proto::CacheGeometry small_geometry(std::uint32_t ranks, proto::CacheDtype dtype = proto::CacheDtype::kBFloat16,
                                           bool with_value = true) {
  proto::CacheGeometry g{};
  g.num_ranks = ranks;
  g.num_layers = 3;
  g.dtype = static_cast<std::uint32_t>(dtype);
  g.num_host_blocks = 24;
  const std::int64_t shape[4] = {32, 2, 4, 8};  // 32 device blocks of 2 heads x 4 tokens x 8 dims
  for (int i = 0; i < 4; ++i) {
    g.key_shape[i] = shape[i];
    g.value_shape[i] = with_value ? shape[i] : 0;
  }
  return g;
}

}  // namespace kvtd::test
