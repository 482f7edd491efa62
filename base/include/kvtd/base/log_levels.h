// kvtd/base/log_levels.h - the log levels --log-level and the control socket's log-level accept
// (spdlog's names), written once for the flag parser and the control request parser.
#pragma once

#include <string_view>

namespace kvtd {

inline constexpr const char* kLogLevelList = "trace, debug, info, warn, error, critical, off";
constexpr bool valid_log_level(std::string_view level) {
  for (std::string_view l : {"trace", "debug", "info", "warn", "error", "critical", "off"})
    if (level == l) return true;
  return false;
}

}  // namespace kvtd
