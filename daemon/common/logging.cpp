#include <fcntl.h>
#include <spdlog/sinks/rotating_file_sink.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <filesystem>

#include "kvtd/daemon/log.h"

namespace kvtd::daemon {

bool init_logging(const std::string& log_dir, const std::string& group, std::uint32_t data_parallel_id,
                  std::uint32_t rank, const std::string& level, std::string* error) {
  const std::string who = fmt::format("{}{}dp{}_rank{}", group, group.empty() ? "" : "_", data_parallel_id, rank);
  try {
    std::vector<spdlog::sink_ptr> sinks;
    sinks.push_back(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    if (!log_dir.empty()) {
      std::filesystem::create_directories(log_dir);
      const auto path = (std::filesystem::path(log_dir) / ("kvtd_" + who + ".log")).string();
      // Every open of a log file (the first and each rotation): create it 0640 without following
      // a symlink (one planted at the log path would otherwise redirect our writes), then make
      // sure the stream spdlog opened is that very file.
      spdlog::file_event_handlers events;
      events.before_open = [](const spdlog::filename_t& name) {
        const int fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0640);
        if (fd < 0) throw spdlog::spdlog_ex("cannot open log file " + name + ": " + std::strerror(errno));
        ::close(fd);
      };
      events.after_open = [](const spdlog::filename_t& name, std::FILE* f) {
        struct stat link {}, opened {};
        if (lstat(name.c_str(), &link) != 0 || S_ISLNK(link.st_mode) || fstat(fileno(f), &opened) != 0 ||
            link.st_ino != opened.st_ino || link.st_dev != opened.st_dev)
          throw spdlog::spdlog_ex("log file " + name + " was replaced by a symlink or another file while opening");
        fchmod(fileno(f), 0640);
      };
      sinks.push_back(std::make_shared<spdlog::sinks::rotating_file_sink_mt>(path, 64u << 20, 5, false, events));
    }
    auto logger = std::make_shared<spdlog::logger>("kvtd", sinks.begin(), sinks.end());
    logger->set_pattern(fmt::format("%Y-%m-%dT%H:%M:%S.%e [dp {} rank {}] [%l] %v", data_parallel_id, rank));
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
