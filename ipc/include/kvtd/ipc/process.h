// kvtd/ipc/process.h - process identity that survives pid reuse, and fencing a process.
//
// A rank's owner is named by proto::owner_word(pid, start time). "Alive" means a process with
// that pid exists, is not a zombie, and started at that time; a reused pid is a different process.
//
// Fencing is how the engine makes "failed" mean "nothing more will be written": it opens a pidfd
// on the owner (so the identity cannot change under it), checks the start time, sends SIGKILL
// through the pidfd and waits until the pidfd reports the exit, by which time the process's
// memory mappings are gone.
//
// Thread-safety: every function is reentrant.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace kvtd::ipc {

// Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or nullopt if there
// is no such process or it is a zombie.
std::optional<std::uint64_t> process_start_ticks(int pid);

// This process's owner word (pid and the low 32 bits of its start time).
std::uint64_t self_owner_word();

// Whether the process named by an owner word is alive (not exited, not a zombie, same start).
bool owner_alive(std::uint64_t owner_word);

enum class FenceOutcome {
  kFenced,    // the process is gone (it was killed and exited, or had exited already)
  kUnfenced,  // it may still be running: no permission, no pidfd support, or it did not exit in time
};
struct FenceResult {
  FenceOutcome outcome = FenceOutcome::kUnfenced;
  std::string detail;  // what happened, for the failure message
};

// Process `pid`'s descriptor `fd` duplicated into this process by pidfd_getfd: the very open file
// description, so with that process's access mode, whatever the caller's rights (close-on-exec).
// -1 with errno when it cannot be taken: ESRCH (no such process), EPERM (no ptrace access to it,
// e.g. Yama's ptrace_scope 1 for a caller that is not root), ENOSYS (before Linux 5.6), EBADF (it
// has no such descriptor). The caller owns the descriptor.
int take_process_descriptor(int pid, int fd);

// Kills the process named by `owner_word` and waits up to timeout_ns for it to exit.
FenceResult fence_process(std::uint64_t owner_word, std::int64_t timeout_ns);

// Whether process `pid` maps the shared object file `name` whose inode is `inode`: from
// /proc/<pid>/maps, by inode and file name (the directory a path shows there depends on whose
// mounts the reader sees: containers differ), so `pid` is a process of this pid namespace. False
// when there is no such process or its maps cannot be read.
bool process_maps_object(int pid, std::uint64_t inode, const std::string& name);

// The engine's fencing hook (tests inject failures through it).
using Fencer = std::function<FenceResult(std::uint64_t owner_word, std::int64_t timeout_ns)>;

}  // namespace kvtd::ipc
