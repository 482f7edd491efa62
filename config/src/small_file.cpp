#include "small_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kvtd::config {

SmallFile read_small_regular_file(const std::string& path, long long max_bytes) {
  SmallFile out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    out.missing = errno == ENOENT;
    out.problem = std::strerror(errno);
    return out;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    out.problem = "not a regular file";
  } else if (st.st_size > max_bytes) {
    out.problem = fmt::format("{} bytes; at most {} are read", st.st_size, max_bytes);
  } else {
    out.text.resize(static_cast<std::size_t>(st.st_size));
    std::size_t got = 0;
    for (ssize_t n; got < out.text.size() && (n = ::read(fd, out.text.data() + got, out.text.size() - got)) > 0;)
      got += static_cast<std::size_t>(n);
    out.text.resize(got);
  }
  ::close(fd);
  return out;
}

}  // namespace kvtd::config
