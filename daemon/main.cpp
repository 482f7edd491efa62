// kvtd: one process per GPU rank that moves KV-cache blocks for an inference engine.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <string>
#include <thread>

#include "kvtd/config/daemon_config.h"
#include "kvtd/ctl/ctl.h"
#include "kvtd/daemon/daemon_main.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/daemon/selftest.h"

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "selftest") return kvtd::daemon::run_selftest(argc - 1, argv + 1);
  if (argc > 1 && std::string(argv[1]) == "ctl") return kvtd::ctl::run_ctl(argc - 1, argv + 1);
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
  if (!kvtd::daemon::init_logging(cfg->log_dir, cfg->group, cfg->data_parallel_id, cfg->rank, cfg->log_level, &log_error)) {
    std::fprintf(stderr, "kvtd: --log-dir: %s\n", log_error.c_str());
    return kvtd::daemon::kExitBadFlags;
  }

  if (!cfg->ignored_flags.empty()) {
    std::string list;
    for (const auto& f : cfg->ignored_flags) list += (list.empty() ? "" : ", ") + f;
    KVTD_WARN("accepted and ignored: {}", list);
  }

  // A peer that closed a socket must fail that call, not kill the daemon.
  signal(SIGPIPE, SIG_IGN);

  // SIGTERM/SIGINT/SIGHUP (and SIGUSR2, main's "signal thread, exit" once `main_done` is set)
  // are blocked in every thread and taken by sigwait in one thread, so no handler runs at all:
  // shutdown happens in ordinary code (rule 7). SIGHUP is acknowledged and ignored: nothing is
  // reloadable, and a closed terminal must not kill a daemon that is serving. A SIGUSR2 from
  // anyone else is ignored too: ending the thread on it left SIGTERM blocked and unhandled.
  static sigset_t set;
  sigemptyset(&set);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGUSR2}) sigaddset(&set, s);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // Static: the signal thread may outlive nothing it uses (it is joined before main returns).
  static std::atomic<bool> stop{false};
  static std::atomic<bool> main_done{false};
  std::thread signals([] {
    int sig = 0;
    while (sigwait(&set, &sig) == 0) {
      if (sig == SIGUSR2) {
        if (main_done.load()) return;  // main is done: stop before logging is shut down
        KVTD_INFO("SIGUSR2 received: kvtd gives it no meaning; ignored");
        continue;
      }
      if (sig == SIGHUP) {
        KVTD_INFO("SIGHUP received: nothing to reload; ignored");
        continue;
      }
      if (stop.exchange(true)) continue;  // a second signal changes nothing: we are draining
      KVTD_INFO("signal {} received: finishing tasks in flight, then exiting", sig);
      kvtd::daemon::notify_stopping();
    }
  });

  const int code = kvtd::daemon::run_daemon(*cfg, stop);
  main_done.store(true);
  pthread_kill(signals.native_handle(), SIGUSR2);
  signals.join();
  spdlog::shutdown();
  return code;
}
