// libFuzzer target: the daemon's configuration. The first byte picks the form: command-line
// arguments (NUL- or newline-separated) or a config file (--config). Any input must end in a
// config or an error message: no crash, no exception escaping, no UB.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvtd/config/daemon_config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool as_file = data[0] & 1;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::vector<std::string> args{"kvtd"};
  if (as_file) {
    static const int fd = memfd_create("kvtd_fuzz_config", 0);
    if (fd < 0) return 0;
    if (ftruncate(fd, 0) != 0 || pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) return 0;
    args.push_back("--config");
    args.push_back("/proc/self/fd/" + std::to_string(fd));
  } else {
    std::string cur;
    for (char c : text) {
      if (c == '\0' || c == '\n') {
        args.push_back(cur);
        cur.clear();
      } else {
        cur.push_back(c);
      }
    }
    args.push_back(cur);
  }
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  auto c = kvtd::config::parse_daemon_flags(static_cast<int>(argv.size()), argv.data());
  if (c.ok()) {
    // Accepted: its sizes must be computable without overflow.
    if (kvtd::proto::geometry_sizes(c->geometry()).problem != nullptr) __builtin_trap();
  }
  return 0;
}
