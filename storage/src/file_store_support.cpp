#include "file_store_support.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>

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
    return make_error(StorageErrc::kInvalidArgument, "store root " + root + " is owned by uid " + std::to_string(st.st_uid) +
                                                         ", not this daemon's (" + std::to_string(::geteuid()) +
                                                         "): another user could plant KV in it");
  if ((st.st_mode & 077) != 0)
    return make_error(StorageErrc::kInvalidArgument, "store root " + root + " has mode " + mode +
                                                         ": other users can reach it (they could plant KV or list "
                                                         "the stored prompt hashes); chmod 700 " + root);
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
  const std::string pid_text = base.substr(start + 1, end - start - 1);
  if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9)
    return false;
  const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

}  // namespace kvtd::storage::detail
