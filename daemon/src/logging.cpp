#include <spdlog/sinks/rotating_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <filesystem>

#include "kvtd/daemon/log.h"

namespace kvtd::daemon {

bool init_logging(const std::string& log_dir, std::uint32_t rank, const std::string& level, std::string* error) {
  try {
    std::vector<spdlog::sink_ptr> sinks;
    sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    if (!log_dir.empty()) {
      std::filesystem::create_directories(log_dir);
      const auto path = (std::filesystem::path(log_dir) / ("kvtd_rank" + std::to_string(rank) + ".log")).string();
      sinks.push_back(std::make_shared<spdlog::sinks::rotating_file_sink_mt>(path, 64u << 20, 5));
    }
    auto logger = std::make_shared<spdlog::logger>("kvtd", sinks.begin(), sinks.end());
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e [rank " + std::to_string(rank) + "] [%l] %v");
    logger->set_level(spdlog::level::from_str(level));
    logger->flush_on(spdlog::level::info);
    spdlog::set_default_logger(logger);
    return true;
  } catch (const std::exception& e) {
    if (error) *error = std::string("cannot set up logging in '") + log_dir + "': " + e.what();
    return false;
  }
}

}  // namespace kvtd::daemon
