// kvtd/daemon/log.h - thin logging macros over spdlog (rule 7). Never use in signal handlers.
#pragma once

#include <spdlog/spdlog.h>

#define KVTD_TRACE(...) SPDLOG_TRACE(__VA_ARGS__)
#define KVTD_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define KVTD_INFO(...) ::spdlog::info(__VA_ARGS__)
#define KVTD_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define KVTD_ERROR(...) ::spdlog::error(__VA_ARGS__)

namespace kvtd::daemon {

// Installs the default logger: stderr plus, when log_dir is non-empty, a rotating file
// <log_dir>/kvtd_dp<data_parallel_id>_rank<rank>.log (64 MiB x 5), or kvtd_<group>_dp<id>_rank<rank>.log
// for an instance of a group, so the ranks of several data-parallel groups and engines can share
// a log directory. Returns false with `error` set on failure.
bool init_logging(const std::string& log_dir, const std::string& group, std::uint32_t data_parallel_id, std::uint32_t rank,
                  const std::string& level, std::string* error);

}  // namespace kvtd::daemon
