// Liveness by open file description locks on a session segment (liveness_lock.h).
#include "kvtd/ipc/liveness_lock.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>

namespace kvtd::ipc {

namespace {

// Every descriptor a LivenessLock holds in this process. A child made by fork() without exec
// shares their open file descriptions, so it would hold the locks on: a live child of a killed
// engine would keep its session "alive". The child's copies are pointed at /dev/null at once
// (the numbers stay valid for the LivenessLock objects the child inherited; the parent's locks
// stay, as a lock goes only with the last descriptor of its description).
std::mutex g_fds_mu;
std::set<int>& held_fds() {
  static std::set<int> fds;
  return fds;
}

void drop_in_child() {
  const int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null < 0) return;
  for (int fd : held_fds()) (void)::dup3(null, fd, O_CLOEXEC);
  ::close(null);
}

void remember(int fd) {
  static const bool registered = [] { return pthread_atfork(nullptr, nullptr, drop_in_child) == 0; }();
  (void)registered;
  std::lock_guard<std::mutex> g(g_fds_mu);
  held_fds().insert(fd);
}

void forget(int fd) {
  std::lock_guard<std::mutex> g(g_fds_mu);
  held_fds().erase(fd);
}

// The object by name, if it is still the one of `inode`: -1 otherwise (errno ENOENT when replaced).
int open_same(const std::string& name, ino_t inode, const std::string& dir) {
  if (!dir.empty() && name.find('/') != std::string::npos) {
    errno = EINVAL;
    return -1;
  }
  const int fd = dir.empty() ? shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0)
                             : ::open((dir + "/" + name).c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return -1;
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_ino != inode) {
    ::close(fd);
    errno = ENOENT;
    return -1;
  }
  return fd;
}

struct flock byte_lock(short type, std::uint64_t byte) {
  struct flock l {};
  l.l_type = type;
  l.l_whence = SEEK_SET;
  l.l_start = static_cast<off_t>(byte);
  l.l_len = 1;
  l.l_pid = 0;  // required for OFD locks
  return l;
}

}  // namespace

Result<LivenessLock, IpcErrc> LivenessLock::take(const std::string& name, ino_t inode, std::uint64_t byte,
                                                 const std::string& dir) {
  const int fd = open_same(name, inode, dir);
  if (fd < 0)
    return make_error(errno == ENOENT ? IpcErrc::kNotFound : IpcErrc::kSystem,
                      "liveness lock of " + name + ": " + std::strerror(errno));
  struct flock l = byte_lock(F_WRLCK, byte);
  if (fcntl(fd, F_OFD_SETLK, &l) != 0) {
    const int e = errno;
    ::close(fd);
    if (e == EAGAIN || e == EACCES)
      return make_error(IpcErrc::kInUse, "byte " + std::to_string(byte) + " of " + name + " is locked by a live process");
    return make_error(IpcErrc::kSystem, "liveness lock of " + name + ": " + std::strerror(e));
  }
  remember(fd);
  return LivenessLock(fd);
}

LivenessLock& LivenessLock::operator=(LivenessLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) {
      forget(fd_);
      ::close(fd_);
    }
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

LivenessLock::~LivenessLock() {
  if (fd_ >= 0) {
    forget(fd_);
    ::close(fd_);
  }
}

LockHolder lock_holder(const std::string& name, ino_t inode, std::uint64_t byte, const std::string& dir) {
  const int fd = open_same(name, inode, dir);
  if (fd < 0) return LockHolder::kUnknown;
  struct flock l = byte_lock(F_WRLCK, byte);
  const int rc = fcntl(fd, F_OFD_GETLK, &l);
  ::close(fd);
  if (rc != 0) return LockHolder::kUnknown;
  return l.l_type == F_UNLCK ? LockHolder::kNone : LockHolder::kHeld;
}

std::uint64_t own_pid_namespace() {
  struct stat st {};
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<std::uint64_t>(st.st_ino);
}

}  // namespace kvtd::ipc
