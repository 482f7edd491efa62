// exposition_line.h (metrics-internal) - one formatted line of the Prometheus text exposition,
// appended to `out`; a line longer than 255 bytes is cut (no series of ours comes near).
#pragma once

#include <cstdio>
#include <string>

namespace kvtd::metrics::detail {

inline void line(std::string& out, const char* fmt, auto... args) {
  char buf[256];
  const int n = std::snprintf(buf, sizeof buf, fmt, args...);
  if (n > 0) out.append(buf, static_cast<std::size_t>(n) < sizeof buf ? static_cast<std::size_t>(n) : sizeof buf - 1);
}

}  // namespace kvtd::metrics::detail
