#include "file_store_support.h"

#include "kvtd/storage/object_format.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <thread>

namespace kvtd::storage::detail {

// The store root must be this user's alone: anyone who can write it can plant objects (the
// object format is public and its checksum only catches accidents), and anyone who can list it
// learns the stored keys, which are prompt-prefix hashes. A missing root is made 0700.
Status<StorageErrc> check_private_root(const std::string& root) {
  struct stat st {};
  if (::lstat(root.c_str(), &st) != 0) {
    if (errno != ENOENT) return make_error(StorageErrc::kIo, "cannot stat " + root + ": " + std::strerror(errno));
    std::error_code ec;
    const auto parent = std::filesystem::path(root).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (::mkdir(root.c_str(), 0700) != 0 && errno != EEXIST)
      return make_error(StorageErrc::kIo, "cannot create " + root + ": " + std::strerror(errno));
    if (::lstat(root.c_str(), &st) != 0) return make_error(StorageErrc::kIo, "cannot stat " + root + ": " + std::strerror(errno));
  }
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  if (S_ISLNK(st.st_mode))
    return make_error(StorageErrc::kInvalidArgument, "store root " + root + " is a symbolic link; name the directory itself");
  if (!S_ISDIR(st.st_mode)) return make_error(StorageErrc::kInvalidArgument, "store root " + root + " is not a directory");
  if (st.st_uid != ::geteuid())
    return make_error(StorageErrc::kInvalidArgument,
                      fmt::format("store root {} is owned by uid {}, not this daemon's ({}): another user could "
                                  "plant KV in it",
                                  root, st.st_uid, ::geteuid()));
  if ((st.st_mode & 077) != 0)
    return make_error(StorageErrc::kInvalidArgument, "store root " + root + " has mode " + mode +
                                                         ": other users can reach it (they could plant KV or list "
                                                         "the stored prompt hashes); chmod 700 " + root);
  return check_ancestors(root);
}

// A private root is not enough: whoever can write one of its parents can rename the root away and
// put a directory of their own, with an object that verifies, in its place. As sshd checks the
// path of authorized_keys (StrictModes): every directory above the root, as named and as resolved,
// belongs to root or to this user, and no other user may write it unless it is sticky (like
// /tmp: there only an entry's owner may rename it, and the entry below is checked to be ours or
// root's). A symbolic link on the way must belong to root or to this user too.
Status<StorageErrc> check_ancestors(const std::string& root) {
  const uid_t me = ::geteuid();
  auto check_chain = [&](const std::filesystem::path& start) -> Status<StorageErrc> {
    for (auto dir = start.parent_path(); !dir.empty(); dir = dir.parent_path()) {
      struct stat st {};
      if (::lstat(dir.c_str(), &st) != 0)
        return make_error(StorageErrc::kIo, "cannot stat " + dir.string() + " (above store root " + root + "): " +
                                                std::strerror(errno));
      if (st.st_uid != 0 && st.st_uid != me)
        return make_error(StorageErrc::kInvalidArgument,
                          fmt::format("{} (above store root {}) belongs to uid {}: that user could replace the root "
                                      "with a directory of their own",
                                      dir.string(), root, st.st_uid));
      const bool others_write = (st.st_mode & 022) != 0 && !S_ISLNK(st.st_mode);
      if (others_write && (st.st_mode & S_ISVTX) == 0) {
        char mode[8];
        std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
        return make_error(StorageErrc::kInvalidArgument,
                          dir.string() + " (above store root " + root + ") has mode " + mode +
                              ": other users may rename what it holds; make it unwritable by them or sticky (chmod o-w,g-w)");
      }
      if (dir == dir.root_path()) break;
    }
    return {};
  };
  const auto named = std::filesystem::absolute(root).lexically_normal();
  KVTD_TRY(check_chain(named));
  std::error_code ec;
  const auto real = std::filesystem::canonical(named, ec);
  if (ec) return make_error(StorageErrc::kIo, "cannot resolve store root " + root + ": " + ec.message());
  if (real != named) KVTD_TRY(check_chain(real));
  return {};
}

// ".tmp-<key>-<pid>-<thread>-<n>" (unique_suffix): whether its writer can no longer rename it.
bool abandoned_temporary(const std::string& base, std::int64_t mtime_ns) {
  constexpr std::int64_t kMaxWriteNs = 600'000'000'000;  // 10 minutes
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  const std::int64_t now_ns = static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
  if (now_ns - mtime_ns > kMaxWriteNs) return true;
  // The pid is the third field from the end (keys may hold '-').
  std::size_t end = base.size();
  for (int field = 0; field < 2; ++field) {
    end = base.rfind('-', end - 1);
    if (end == std::string::npos || end == 0) return false;
  }
  const std::size_t start = base.rfind('-', end - 1);
  if (start == std::string::npos) return false;
  std::string pid_text = base.substr(start + 1, end - start - 1);
  // "<pid>p<pid namespace>": a writer of another pid namespace (another container on this store)
  // is nobody, or someone else, by its pid here: only its age can tell.
  if (const auto p = pid_text.find('p'); p != std::string::npos) {
    const std::string ns = pid_text.substr(p + 1);
    if (ns.empty() || ns.find_first_not_of("0123456789") != std::string::npos || ns != std::to_string(own_pid_namespace()))
      return false;
    pid_text.resize(p);
  }
  if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9)
    return false;
  const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

std::uint64_t own_pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

Status<StorageErrc> make_fanout(FileSystem& fs, const std::string& dir) {
  for (unsigned i = 0; i < 256; ++i) {
    char fan[3];
    std::snprintf(fan, sizeof fan, "%02x", i);
    if (int e = fs.make_dirs(dir + "/" + fan); e != 0)
      return make_error(StorageErrc::kIo, "cannot create " + dir + "/" + fan + ": " + std::strerror(e));
  }
  return {};
}

std::optional<ObjectName> parse_stored_path(const std::string& root, const std::string& path, const std::string& suffix) {
  const std::string base = root.empty() || root.back() == '/' ? root : root + "/";
  if (path.compare(0, base.size(), base) != 0) return std::nullopt;
  std::vector<std::string> parts;
  for (std::size_t at = base.size(); at <= path.size();) {
    const auto slash = path.find('/', at);
    parts.push_back(path.substr(at, slash == std::string::npos ? std::string::npos : slash - at));
    if (slash == std::string::npos) break;
    at = slash + 1;
  }
  if (parts.size() != 4 || parts[2].size() != 2) return std::nullopt;
  const std::string& file = parts[3];
  if (file.size() <= suffix.size() || file.compare(file.size() - suffix.size(), suffix.size(), suffix) != 0 ||
      file[0] == '.')
    return std::nullopt;
  return ObjectName::parse(parts[0] + "/" + parts[1] + "/" + file.substr(0, file.size() - suffix.size()));
}

std::string unique_suffix() {
  static std::atomic<std::uint64_t> counter{0};
  static const std::uint64_t pid_namespace = own_pid_namespace();
  return fmt::format("{}p{}-{}-{}", ::getpid(), pid_namespace, std::hash<std::thread::id>{}(std::this_thread::get_id()),
                     counter.fetch_add(1));
}

Result<GcReport, StorageErrc> collect_files(FileSystem& fs, const std::string& root, const std::string& suffix,
                                            const std::string& own_model, const GcRequest& r,
                                            const std::function<void(const std::string& path)>& forget) {
  std::vector<FileEntry> files;
  if (int e = fs.list_files(root, &files); e != 0)
    return make_error(StorageErrc::kIo, "cannot list " + root + ": " + std::strerror(e));
  GcReport rep;
  for (const auto& f : files) {
    if (r.deadline_ns != 0 && monotonic_ns() > r.deadline_ns) {
      rep.complete = false;
      break;
    }
    const auto o = parse_stored_path(root, f.path, suffix);
    if (!o) continue;  // a temporary, or not an object of kvtd's
    ++rep.examined;
    if (gc_keeps(r, own_model, *o)) {
      ++rep.kept;
      continue;
    }
    // Only what kvtd wrote under this name goes: a file that merely looks like an object stays.
    ObjectHeader h{};
    std::size_t got = 0;
    const std::span<std::byte> head(reinterpret_cast<std::byte*>(&h), sizeof h);
    if (fs.read_file(f.path, std::span<const std::span<std::byte>>(&head, 1), &got) != 0 || got != sizeof h ||
        !written_by_kvtd(h, o->encode())) {
      ++rep.foreign;
      continue;
    }
    if (r.dry_run) {
      ++rep.removed;
      rep.removed_bytes += f.bytes;
      continue;
    }
    const int e = fs.remove(f.path);
    if (e != 0 && e != ENOENT) {
      ++rep.failed;
      if (rep.first_failure.empty()) rep.first_failure = "remove " + f.path + ": " + std::strerror(e);
      continue;
    }
    if (e == 0) {  // ENOENT: another collector sharing the root was first
      ++rep.removed;
      rep.removed_bytes += f.bytes;
      if (r.on_removed) r.on_removed(o->model, o->name);
    }
    forget(f.path);
  }
  return rep;
}

std::int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace kvtd::storage::detail
