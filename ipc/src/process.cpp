#include "kvtd/ipc/process.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string_view>

#include "kvtd/proto/session.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

namespace kvtd::ipc {

std::optional<std::uint64_t> process_start_ticks(int pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  // The command name (field 2) is in parentheses and may hold spaces: parse after the last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 1));
  std::string state;
  rest >> state;  // field 3
  if (state == "Z" || state == "X") return std::nullopt;
  std::string skip;
  for (int field = 4; field < 22; ++field) rest >> skip;
  std::uint64_t start = 0;
  if (!(rest >> start)) return std::nullopt;
  return start;
}

std::uint64_t self_owner_word() {
  const int pid = static_cast<int>(getpid());
  const std::uint64_t start = process_start_ticks(pid).value_or(0);
  return proto::owner_word(static_cast<std::uint32_t>(pid), static_cast<std::uint32_t>(start));
}

bool owner_alive(std::uint64_t word) {
  const int pid = static_cast<int>(proto::owner_pid(word));
  if (pid <= 0) return false;
  const auto start = process_start_ticks(pid);
  return start && static_cast<std::uint32_t>(*start) == proto::owner_start(word);
}

int take_process_descriptor(int pid, int fd) {
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) return -1;
  const int taken = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  const int e = errno;
  close(pidfd);
  errno = e;
  return taken;
}

FenceResult fence_process(std::uint64_t word, std::int64_t timeout_ns) {
  const int pid = static_cast<int>(proto::owner_pid(word));
  const std::string who = "process " + std::to_string(pid);
  if (pid <= 0) return {FenceOutcome::kUnfenced, "no owner process recorded"};
  if (pid == static_cast<int>(getpid())) return {FenceOutcome::kUnfenced, "the rank is served by this very process"};
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0) {
    if (errno == ESRCH) return {FenceOutcome::kFenced, who + " had exited"};
    return {FenceOutcome::kUnfenced, "pidfd_open(" + std::to_string(pid) + "): " + std::strerror(errno)};
  }
  // The pidfd pins the identity; a different start time means the owner exited and its pid was
  // reused by someone else, who must not be killed.
  const auto start = process_start_ticks(pid);
  if (!start || static_cast<std::uint32_t>(*start) != proto::owner_start(word)) {
    close(fd);
    return {FenceOutcome::kFenced, who + " had exited"};
  }
  if (syscall(SYS_pidfd_send_signal, fd, SIGKILL, nullptr, 0) != 0 && errno != ESRCH) {
    const int e = errno;
    close(fd);
    return {FenceOutcome::kUnfenced, "cannot kill " + who + ": " + std::strerror(e)};
  }
  pollfd p{fd, POLLIN, 0};
  const int ms = static_cast<int>(std::min<std::int64_t>(timeout_ns / 1'000'000, 600'000));
  int r = 0;
  do {
    r = poll(&p, 1, ms);
  } while (r < 0 && errno == EINTR);
  close(fd);
  if (r == 1) return {FenceOutcome::kFenced, who + " was killed and has exited"};
  return {FenceOutcome::kUnfenced, who + " was sent SIGKILL but had not exited after " + std::to_string(ms) + " ms"};
}

bool process_maps_object(int pid, std::uint64_t inode, const std::string& name) {
  if (pid <= 0) return false;
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  const std::string_view deleted = " (deleted)";
  std::string line;
  while (std::getline(in, line)) {
    // start-end perms offset dev inode path
    std::istringstream fields(line);
    std::string range, perms, offset, dev;
    std::uint64_t ino = 0;
    if (!(fields >> range >> perms >> offset >> dev >> ino) || ino != inode) continue;
    std::string_view path(line);
    if (path.size() >= deleted.size() && path.substr(path.size() - deleted.size()) == deleted)
      path.remove_suffix(deleted.size());
    const auto slash = path.rfind('/');
    if (slash != std::string_view::npos && path.substr(slash + 1) == name) return true;
  }
  return false;
}

}  // namespace kvtd::ipc
