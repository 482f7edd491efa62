// kvtd: one process per GPU rank that moves KV-cache blocks for an inference engine.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <thread>

#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/daemon_main.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/daemon/selftest.h"

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "selftest") return kvtd::daemon::run_selftest(argc - 1, argv + 1);
  auto cfg = kvtd::config::parse_daemon_flags(argc, argv);
  if (!cfg.ok()) {
    if (cfg.error().code == kvtd::config::ConfigErrc::kHelp) {
      std::fputs(cfg.error().message.c_str(), stdout);
      return 0;
    }
    std::fprintf(stderr, "kvtd: %s\n", cfg.error().message.c_str());
    return kvtd::daemon::kExitBadFlags;
  }
  std::string log_error;
  if (!kvtd::daemon::init_logging(cfg->log_dir, cfg->rank, cfg->log_level, &log_error)) {
    std::fprintf(stderr, "kvtd: --log-dir: %s\n", log_error.c_str());
    return kvtd::daemon::kExitBadFlags;
  }

  // A peer that closed a socket must fail that call, not kill the daemon.
  signal(SIGPIPE, SIG_IGN);

  // SIGTERM/SIGINT are blocked in every thread and taken by sigwait in one thread, so no
  // handler runs at all: shutdown happens in ordinary code (rule 7).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::atomic<bool> stop{false};
  std::thread signals([&set, &stop] {
    int sig = 0;
    while (sigwait(&set, &sig) == 0) {
      if (sig == SIGTERM || sig == SIGINT) {
        if (stop.exchange(true)) continue;  // a second signal changes nothing: we are draining
        KVTD_INFO("signal {} received: finishing tasks in flight, then exiting", sig);
        kvtd::daemon::notify_stopping();
        return;
      }
    }
  });
  signals.detach();

  const int code = kvtd::daemon::run_daemon(*cfg, stop);
  spdlog::shutdown();
  return code;
}
