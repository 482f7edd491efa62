// Sessions that are gone: sweeping what dead engines left in /dev/shm (and pool directories).
// It reads other processes' segments and pool headers, so it treats them as hostile input.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <stdio.h>  // renameat2

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <ctime>
#include <set>
#include <string>
#include <vector>

#include "kvtd/ipc/liveness_lock.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/segment.h"
#include "kvtd/proto/names.h"
#include "kvtd/ipc/shared_object.h"

namespace kvtd::ipc {

namespace {

// The session header's magic, read once with acquire: complete only once it is kSessionMagic.
std::uint64_t magic_of(const proto::SessionHeader& h) {
  return std::atomic_ref<std::uint64_t>(const_cast<std::uint64_t&>(h.magic)).load(std::memory_order_acquire);
}

// The entries of directory `at` whose names start with `prefix` (none when it cannot be read).
std::vector<std::string> names_with_prefix(const std::string& at, const std::string& prefix) {
  std::vector<std::string> found;
  if (DIR* dir = opendir(at.c_str())) {
    while (dirent* e = readdir(dir)) {
      const std::string n = e->d_name;
      if (n.compare(0, prefix.size(), prefix) == 0) found.push_back(n);
    }
    closedir(dir);
  }
  return found;
}

// Per-session objects: "<prefix><16 hex>_dev<digits>", "_host<digits>" or "_fdcache<digits>" (a
// daemon's exported cache); true with the generation (and whether it is a host pool) for one of
// those.
bool parse_session_object(const std::string& n, const std::string& prefix, std::uint64_t* gen,
                          bool* host_pool = nullptr) {
  const std::string rest = n.substr(prefix.size());
  if (rest.size() < 18 || rest[16] != '_') return false;
  const std::string tail = rest.substr(17);
  std::size_t digits_at = 0;
  if (tail.compare(0, 3, "dev") == 0) digits_at = 3;
  else if (tail.compare(0, 4, "host") == 0) digits_at = 4;
  else if (tail.compare(0, 7, "fdcache") == 0) digits_at = 7;
  else return false;
  if (digits_at == tail.size()) return false;
  for (std::size_t i = digits_at; i < tail.size(); ++i)
    if (tail[i] < '0' || tail[i] > '9') return false;
  const std::string hex = rest.substr(0, 16);
  for (char c : hex)
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  *gen = std::strtoull(hex.c_str(), nullptr, 16);
  if (host_pool) *host_pool = digits_at == 4;
  return true;
}

// Whether the host pool file `name` in `dir` ("" for /dev/shm) has a live holder: a daemon holds
// its lock (kPoolHolderLockByte: seen from any pid namespace, so a sweep in another container
// never takes a live daemon's pool for a dead one's), or, failing that, the holder its header
// names is a live process here (a daemon between giving up one lock and taking the next). The
// header is read with one pread, not mapped (another process's, hostile, memory); a short or
// incomplete one names no holder.
bool pool_holder_alive(const std::string& dir, const std::string& name) {
  const std::string path = (dir.empty() ? std::string("/dev/shm") : dir) + "/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  proto::HostPoolPrefix prefix{};
  const ssize_t got = ::pread(fd, &prefix, sizeof prefix, 0);
  struct stat st {};
  const bool stat_ok = fstat(fd, &st) == 0;
  ::close(fd);
  if (stat_ok && lock_holder(name, st.st_ino, kPoolHolderLockByte, dir) == LockHolder::kHeld) return true;
  return got == static_cast<ssize_t>(sizeof prefix) && prefix.magic == proto::kHostPoolMagic && prefix.holder != 0 &&
         owner_alive(prefix.holder);
}

// Removes the dead session segment `n` of /dev/shm only if the name still holds the object judged
// dead (inode `dead`). A sweep's listing is not a snapshot: between this sweep judging a session
// dead and removing it, a new engine of the same suffix may have removed the dead segment and
// made its own under the name (EngineSession::create does both), and removing by name unlinked
// the live session, whose daemons then waited for it "to appear" forever (the flake of
// CudaDaemonTest.AnEngineKilledWithItsEventPendingNeverWedgesTheDaemon under ctest -j 2). The
// object is moved aside first (rename is atomic), checked there, and unlinked only if it is the
// dead one; a live one goes back under its name (never over another: RENAME_NOREPLACE).
bool remove_dead_session(const std::string& n, const std::string& prefix, ino_t dead) {
  static std::atomic<std::uint64_t> moves{0};
  const std::string at = "/dev/shm/" + n;
  // '+' is in no session suffix and no generation: no engine or sweep takes this name for one.
  const std::string aside =
      "/dev/shm/" + prefix + "+swept_" + std::to_string(getpid()) + "_" + std::to_string(moves.fetch_add(1));
  if (renameat2(AT_FDCWD, at.c_str(), AT_FDCWD, aside.c_str(), RENAME_NOREPLACE) != 0) {
    if (errno != EINVAL && errno != ENOSYS && errno != EPERM) return false;  // gone, or taken meanwhile
    // No renameat2 here (an old kernel, a sandbox): check the inode right before the unlink, a
    // window of one system call instead of the whole sweep's.
    struct stat now {};
    if (lstat(at.c_str(), &now) != 0 || now.st_ino != dead) return false;
    return ::unlink(at.c_str()) == 0;
  }
  struct stat st {};
  if (lstat(aside.c_str(), &st) == 0 && st.st_ino == dead) {
    ::unlink(aside.c_str());
    return true;
  }
  // A live session was moved: back at once (its daemons retry a missing name). Should another
  // object have taken the name meanwhile, this one stays aside: a later sweep removes it once its
  // creator is dead, as it does any segment.
  (void)renameat2(AT_FDCWD, aside.c_str(), AT_FDCWD, at.c_str(), RENAME_NOREPLACE);
  return false;
}

}  // namespace

std::vector<std::string> sweep_stale_objects(const std::vector<std::string>& object_dirs) {
  return detail::sweep_stale_objects_judged(object_dirs, {});
}

namespace detail {

std::vector<std::string> sweep_stale_objects_judged(const std::vector<std::string>& object_dirs,
                                                    const std::function<void()>& after_judging) {
  std::vector<std::string> removed;
  const std::string prefix = "kvtd_" + std::to_string(getuid()) + "_";
  auto list = [&](const std::string& at) { return names_with_prefix(at, prefix); };
  const std::vector<std::string> names = list("/dev/shm");
  if (names.empty() && object_dirs.empty()) return removed;

  std::set<std::uint64_t> live;
  std::vector<std::pair<std::string, ino_t>> dead_sessions;  // name, the object judged dead
  // A directory listing is not a snapshot: one taken while another engine is creating its
  // session may hold its new arena but not its segment. Objects touched in the last 30 s are
  // therefore never swept; an orphan is always older than that by the next sweep.
  const time_t fresh_after = time(nullptr) - 30;
  for (const auto& n : names) {
    std::uint64_t gen = 0;
    if (parse_session_object(n, prefix, &gen)) continue;
    auto o = SharedObject::open(n);
    if (!o.ok()) continue;
    if ((*o)->owner_uid() != getuid() || (*o)->size() < sizeof(proto::SessionHeader)) continue;
    const auto* h = reinterpret_cast<const proto::SessionHeader*>((*o)->data());
    const std::uint64_t magic = magic_of(*h);
    if (magic == 0) {
      // A session being created: its objects may not be visible yet, so nothing is swept now.
      // One untouched for 30 s whose creator holds no lock on it was abandoned mid-creation (its
      // creator died): it is swept as a dead session's, not left to stop every later sweep.
      struct stat st {};
      if (lstat(("/dev/shm/" + n).c_str(), &st) == 0 && st.st_mtime < fresh_after && st.st_ino == (*o)->inode() &&
          lock_holder(n, (*o)->inode(), kEngineLockByte) == LockHolder::kNone) {
        dead_sessions.emplace_back(n, (*o)->inode());
        continue;
      }
      return removed;
    }
    if (magic != proto::kSessionMagic) continue;
    // By the creator's lock, not its pid: a sweep in another pid namespace (a daemon's container)
    // saw the live engine's pid as nobody and swept its session, arenas and host pools.
    const bool alive = detail::creator_liveness(**o).alive;
    if (alive && h->state.load(std::memory_order_acquire) != static_cast<std::uint32_t>(proto::SessionState::kClosed))
      live.insert(h->generation);
    else if (!alive)
      dead_sessions.emplace_back(n, (*o)->inode());
  }
  auto sweep_objects_in = [&](const std::string& dir, const std::vector<std::string>& in_dir) {
    const std::string at = dir.empty() ? std::string("/dev/shm") : dir;
    for (const auto& n : in_dir) {
      std::uint64_t gen = 0;
      bool host_pool = false;
      struct stat st {};
      if (!parse_session_object(n, prefix, &gen, &host_pool) || live.count(gen) ||
          lstat((at + "/" + n).c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != getuid() ||
          st.st_mtime >= fresh_after)
        continue;
      // A dead engine's pool its daemon keeps for the engine's restart (or a pool of a session
      // whose daemon has not yet seen its engine die): the daemon removes or hands it on.
      if (host_pool && pool_holder_alive(dir, n)) continue;
      SharedObject::remove(n, dir);
      removed.push_back(dir.empty() ? n : dir + "/" + n);
    }
  };
  sweep_objects_in("", names);
  for (const auto& dir : object_dirs) sweep_objects_in(dir, list(dir));
  if (after_judging) after_judging();
  for (const auto& [n, inode] : dead_sessions)
    if (remove_dead_session(n, prefix, inode)) removed.push_back(n);
  return removed;
}

bool process_alive(pid_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno != ESRCH); }

CreatorLiveness creator_liveness(const SharedObject& seg) {
  if (seg.size() < sizeof(proto::SessionHeader)) return {};
  const auto* h = reinterpret_cast<const proto::SessionHeader*>(seg.data());
  const std::uint32_t pid = h->creator_pid;
  const std::uint32_t version = h->layout_version;
  const LockHolder lock = lock_holder(seg.name(), seg.inode(), kEngineLockByte);
  const std::string in_its_namespace = "creator pid " + std::to_string(pid) + " in its own pid namespace";
  if (lock == LockHolder::kHeld) return {true, "it holds its lock on the session; " + in_its_namespace};
  // A complete header of this layout without the lock: its engine exited (in whatever namespace).
  // A header still being written (version 0) has its creator's lock from before it is written.
  if (lock == LockHolder::kNone && (version == proto::kSessionLayoutVersion || version == 0))
    return {false, "its lock on the session is released; " + in_its_namespace};
  return {process_alive(static_cast<pid_t>(pid)), "process " + std::to_string(pid)};
}

}  // namespace detail
}  // namespace kvtd::ipc
