// Liveness by open file description locks on a session segment (liveness_lock.h).
#include "kvtd/ipc/liveness_lock.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kvtd::ipc {

namespace {

// The object by name, if it is still the one of `inode`: -1 otherwise (errno ENOENT when replaced).
int open_same(const std::string& name, ino_t inode) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
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

Result<LivenessLock, IpcErrc> LivenessLock::take(const std::string& name, ino_t inode, std::uint64_t byte) {
  const int fd = open_same(name, inode);
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
  return LivenessLock(fd);
}

LivenessLock& LivenessLock::operator=(LivenessLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

LivenessLock::~LivenessLock() {
  if (fd_ >= 0) ::close(fd_);
}

LockHolder lock_holder(const std::string& name, ino_t inode, std::uint64_t byte) {
  const int fd = open_same(name, inode);
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
