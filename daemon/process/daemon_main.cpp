#include "kvtd/daemon/daemon_main.h"

#include "rank_server.h"
#include "start_up.h"

namespace kvtd::daemon {

int run_daemon(const config::DaemonConfig& cfg, std::atomic<bool>& stop) {
  Services services;
  if (auto code = start_up(cfg, stop, services)) return *code;
  return RankServer(cfg, services, stop).run();
}

}  // namespace kvtd::daemon
