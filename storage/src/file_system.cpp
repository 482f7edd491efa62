#include "kvtd/storage/file_system.h"

#include "uring_reads.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <climits>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>

namespace kvtd::storage {
namespace {

class PosixFileSystem final : public FileSystem {
 public:
  int write_file(const std::string& path, std::span<const std::span<const std::byte>> parts, bool sync) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return errno;
    int err = 0;
    for (auto part : parts) {
      std::size_t done = 0;
      while (done < part.size()) {
        const ssize_t n = ::write(fd, part.data() + done, part.size() - done);
        if (n < 0) {
          if (errno == EINTR) continue;
          err = errno;
          break;
        }
        done += static_cast<std::size_t>(n);
      }
      if (err) break;
    }
    if (!err && sync && ::fsync(fd) != 0) err = errno;
    if (::close(fd) != 0 && !err) err = errno;
    return err;
  }

  // One readv per up to IOV_MAX parts (a load reads an object straight into its destination's
  // pieces: header, 2 x layers blocks, one byte past the end); a short read resumes where it
  // stopped; end of file stops it (a truncated object).
  int read_file(const std::string& path, std::span<const std::span<std::byte>> parts, std::size_t* read) override {
    *read = 0;
    // Non-blocking, then checked: a FIFO (or a device) planted where an object belongs must not
    // hold the load past its deadline; it is no object, so nothing is read (a corrupt object).
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return errno;
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return 0;
    }
    std::vector<iovec> iov;
    iov.reserve(parts.size());
    for (auto part : parts)
      if (!part.empty()) iov.push_back(iovec{part.data(), part.size()});
    int err = 0;
    std::size_t at = 0;
    while (at < iov.size()) {
      const int count = static_cast<int>(std::min<std::size_t>(iov.size() - at, IOV_MAX));
      const ssize_t n = ::readv(fd, iov.data() + at, count);
      if (n < 0) {
        if (errno == EINTR) continue;
        err = errno;
        break;
      }
      if (n == 0) break;  // end of file: truncated object
      *read += static_cast<std::size_t>(n);
      // Skip the iovecs this read filled; shorten the one it filled in part.
      auto left = static_cast<std::size_t>(n);
      while (at < iov.size() && left >= iov[at].iov_len) left -= iov[at++].iov_len;
      if (left != 0) {
        iov[at].iov_base = static_cast<std::byte*>(iov[at].iov_base) + left;
        iov[at].iov_len -= left;
      }
    }
    ::close(fd);
    return err;
  }

  int rename(const std::string& from, const std::string& to) override {
    return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno;
  }
  int remove(const std::string& path) override {
    return ::unlink(path.c_str()) == 0 || errno == ENOENT ? 0 : errno;
  }
  int exists(const std::string& path, bool* present) override {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) {
      *present = true;
      return 0;
    }
    *present = false;
    return errno == ENOENT || errno == ENOTDIR ? 0 : errno;
  }
  // Directories the store makes are 0700 whatever the umask: keys are prompt-prefix hashes.
  int make_dirs(const std::string& path) override {
    std::string part;
    std::size_t pos = 0;
    while (pos != std::string::npos) {
      pos = path.find('/', pos + 1);
      part = path.substr(0, pos);
      if (part.empty()) continue;
      if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) return errno;
    }
    return 0;
  }
  int sync_dir(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    const int rc = ::fsync(fd) == 0 ? 0 : errno;
    ::close(fd);
    return rc;
  }
  int list_files(const std::string& root, std::vector<FileEntry>* out) override {
    std::error_code ec;
    if (!std::filesystem::exists(root, ec)) return 0;
    for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
         !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
      if (!it->is_regular_file(ec)) continue;
      struct stat st {};
      if (::stat(it->path().c_str(), &st) != 0) continue;
      out->push_back(FileEntry{it->path().string(), static_cast<std::uint64_t>(st.st_size),
                               static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec});
    }
    return ec ? ec.value() : 0;
  }
  int read_direct(std::span<DirectRead> reads) override { return detail::read_direct_with_uring(reads); }
};

}  // namespace

std::unique_ptr<FileSystem> make_posix_file_system() { return std::make_unique<PosixFileSystem>(); }

}  // namespace kvtd::storage
