// kvtd/ipc/liveness_lock.h - liveness that holds across pid namespaces.
//
// A pid names a process only inside its own pid namespace: an engine and a daemon in two
// containers of one pod (sharing /dev/shm, not a pid namespace) see each other's pids as nothing
// or as someone else, and a container restarted in place gets the same small pids again. So a
// session's processes say they are alive by what both sides see: an open file description lock
// (fcntl F_OFD_SETLK) on one byte of the session segment. The kernel drops it when the holder's
// last descriptor of it closes (its exit, however it ends); a stopped holder keeps it.
//
//   byte 0          the engine that created the session (EngineSession, for its lifetime)
//   byte 1 + rank   the daemon serving that rank (RankEndpoint, while attached)
//
// A host pool object (kvtd_<uid>_<generation>_host<r>) carries one such lock too, at byte 0: its
// holder's, so a sweep in another container never takes a live daemon's pool for a dead one's.
//
// Who may signal whom is a question of namespaces too: a process can be fenced through a pidfd
// only from its own pid namespace (or an ancestor); each side publishes the inode of its
// /proc/self/ns/pid (own_pid_namespace) so the other can tell.
//
// Ownership: a LivenessLock owns its descriptor; the lock lives until it is destroyed, and never
// in a child made by fork() (its copy of the descriptor is pointed at /dev/null in the child, so a
// live child never keeps a dead parent's lock). Movable, not copyable. Thread-safety: the functions are reentrant; one LivenessLock is not shared.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "kvtd/ipc/errors.h"
#include "kvtd/proto/expected.h"

namespace kvtd::ipc {

inline constexpr std::uint64_t kEngineLockByte = 0;
constexpr std::uint64_t rank_lock_byte(std::uint32_t rank) { return 1 + std::uint64_t{rank}; }

class LivenessLock {
 public:
  // Locks `byte` of /dev/shm object `name` (of a file `name` in `dir` when not empty), whose inode
  // must be `inode` (the object the caller mapped, not one that replaced it under the name:
  // kNotFound). kInUse when a live process holds it (any process, any namespace, this one through
  // another descriptor included).
  static Result<LivenessLock, IpcErrc> take(const std::string& name, ino_t inode, std::uint64_t byte,
                                            const std::string& dir = {});
  LivenessLock() = default;
  LivenessLock(LivenessLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  LivenessLock& operator=(LivenessLock&& o) noexcept;
  LivenessLock(const LivenessLock&) = delete;
  LivenessLock& operator=(const LivenessLock&) = delete;
  ~LivenessLock();
  bool held() const { return fd_ >= 0; }

 private:
  explicit LivenessLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

enum class LockHolder {
  kNone,     // nobody holds it: whoever did has exited
  kHeld,     // a process holds it (running or stopped; in any pid namespace)
  kUnknown,  // the object is gone, was replaced (another inode) or cannot be asked
};
// Who holds `byte` of /dev/shm object `name` (or of file `name` in `dir`; inode `inode`), asked
// without taking it.
LockHolder lock_holder(const std::string& name, ino_t inode, std::uint64_t byte, const std::string& dir = {});

// The byte of a host pool object its holder (the daemon that maps it, or keeps it for its
// engine's restart) locks: liveness of the holder in any pid namespace.
inline constexpr std::uint64_t kPoolHolderLockByte = 0;

// The inode of this process's pid namespace (/proc/self/ns/pid), or 0 when it cannot be read.
std::uint64_t own_pid_namespace();

}  // namespace kvtd::ipc
