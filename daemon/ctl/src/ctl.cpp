// `kvtd ctl`: asks running daemons what they are doing, over their control sockets.
//
//   kvtd ctl [--session S] [--dp D] [--rank R | --all] [--endpoint E] [--timeout SEC] [--json]
//            status | drain | log-level LEVEL | clear [--drop-host-tier] | restore
//
// clear / restore act on the daemon alone (the engine's clear_caches()/restore_caches() are the
// engine-driven path): clear finishes the tasks in flight and closes every mapping of the
// engine's KV tensors, failing later tasks with cache_cleared until restore re-reads the tensor
// registry and re-opens it. Each daemon answers once it got there (up to 20 s).
//
// Default: every rank of the session found in the runtime directory (--all). A readable table
// by default, the daemons' JSON with --json. Exit 0 when every asked daemon answered ok, 1 when
// one did not answer in time or refused, 2 for bad arguments.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "kvtd/control/control.h"
#include "kvtd/ctl/ctl.h"

namespace kvtd::ctl {
namespace {

// The daemon's exit code for bad flags (kvtd/daemon/daemon_main.h), so scripts read both alike.
constexpr int kExitBadFlags = 2;

using json = nlohmann::json;

std::string gb(std::uint64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GB", static_cast<double>(bytes) / 1e9);
  return b;
}

// One readable line per rank for `status`.
void print_status(std::uint32_t rank, const json& r) {
  std::uint64_t ok = 0, failed = 0;
  for (const auto& t : r["tasks"]) (t["status"] == "ok" ? ok : failed) += t["count"].get<std::uint64_t>();
  const auto& errors = r["last_errors"];
  std::printf("rank %-3u %-9s epoch %-4u pid %-7lld tasks %llu ok %llu failed  to host %s  to device %s  queue %llu B  "
              "host pool %s  storage %s%s%s\n",
              rank, r["attached"].get<bool>() ? "attached" : "waiting", r["epoch"].get<unsigned>(),
              r["pid"].get<long long>(), static_cast<unsigned long long>(ok), static_cast<unsigned long long>(failed),
              gb(r["bytes"]["to_host"].get<std::uint64_t>()).c_str(),
              gb(r["bytes"]["to_device"].get<std::uint64_t>()).c_str(),
              static_cast<unsigned long long>(r["queue_depth_bytes"].get<std::uint64_t>()),
              gb(r["host_pool_bytes"].get<std::uint64_t>()).c_str(),
              r["storage"]["backend"].get<std::string>().c_str(),
              r["draining"].get<bool>() ? "  DRAINING" : (r.value("cache", "") == "cleared" ? "  CACHE CLEARED" : ""),
              errors.empty() ? "" : ("\n         last error: " + errors.back().get<std::string>()).c_str());
}

}  // namespace

int run_ctl(int argc, char** argv) {
  CLI::App app{"kvtd ctl - ask running kvtd daemons (status, drain, log-level, clear, restore)", "kvtd ctl"};
  std::string session, endpoint, command, level;
  std::uint32_t dp = 0;
  std::int64_t rank = -1;
  bool all = false, as_json = false, drop_host_tier = false;
  double timeout_s = 2.0;
  app.add_option("--session,--ipc_suffix", session, "Session suffix of the daemons (required unless --endpoint)");
  app.add_option("--dp,--local_data_parallel_id", dp, "Data-parallel group (default 0)");
  app.add_option("--rank", rank, "Only this rank");
  app.add_flag("--all", all, "Every rank of the session found in the runtime directory (the default)");
  app.add_option("--endpoint", endpoint, "One daemon by endpoint (ipc://... or tcp://127.0.0.1:port)");
  std::string secret_file;
  app.add_option("--secret-file", secret_file, "tcp:// endpoints: the daemon's --control-secret-file");
  app.add_option("--timeout", timeout_s, "Seconds to wait for each daemon (default 2)");
  app.add_flag("--json", as_json, "Print the daemons' JSON replies");
  app.add_flag("--drop-host-tier", drop_host_tier, "clear: also invalidate the host pool (its KV is the old weights')");
  app.add_option("command", command, "status | drain | log-level | clear | restore")->required();
  app.add_option("level", level, "log-level: trace | debug | info | warn | error | critical | off");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitBadFlags;
  }
  control::Request req;
  req.command = command;
  req.level = level;
  req.drop_host_tier = drop_host_tier;
  if (!secret_file.empty()) {
    auto secret = control::read_secret_file(secret_file);
    if (!secret.ok()) {
      std::fprintf(stderr, "kvtd ctl: %s\n", secret.error().message.c_str());
      return kExitBadFlags;
    }
    req.token = std::move(secret).value();
  }
  json probe{{"command", command}};
  if (!level.empty()) probe["level"] = level;
  if (drop_host_tier) probe["drop_host_tier"] = true;
  if (auto checked = control::parse_request(probe.dump()); !checked.ok()) {
    std::fprintf(stderr, "kvtd ctl: %s\n", checked.error().message.c_str());
    return kExitBadFlags;
  }
  if (!(timeout_s > 0 && timeout_s <= 600)) {
    std::fprintf(stderr, "kvtd ctl: --timeout must be in (0, 600] seconds\n");
    return kExitBadFlags;
  }
  if (rank >= 0 && all) {
    std::fprintf(stderr, "kvtd ctl: --rank and --all exclude each other\n");
    return kExitBadFlags;
  }

  std::vector<std::pair<std::uint32_t, std::string>> targets;
  if (!endpoint.empty()) {
    targets.emplace_back(rank >= 0 ? static_cast<std::uint32_t>(rank) : 0, endpoint);
  } else {
    if (session.empty()) {
      std::fprintf(stderr, "kvtd ctl: --session (the daemons' --session / --ipc_suffix) or --endpoint is required\n");
      return kExitBadFlags;
    }
    auto dir = control::runtime_dir();
    if (!dir.ok()) {
      std::fprintf(stderr, "kvtd ctl: %s\n", dir.error().message.c_str());
      return 1;
    }
    if (rank >= 0) {
      targets.emplace_back(static_cast<std::uint32_t>(rank),
                           "ipc://" + control::socket_path(*dir, session, dp, static_cast<std::uint32_t>(rank)));
    } else {
      for (auto& [r, path] : control::find_sockets(*dir, session, dp)) targets.emplace_back(r, "ipc://" + path);
      if (targets.empty()) {
        std::fprintf(stderr, "kvtd ctl: no daemon of session '%s' (dp %u) has a control socket in %s\n",
                     session.c_str(), dp, dir->c_str());
        return 1;
      }
    }
  }

  int code = 0;
  json all_replies = json::array();
  for (const auto& [r, ep] : targets) {
    // A clear waits for the tasks in flight: the daemon answers within 20 s, so wait longer.
    const double wait_s = command == "clear" || command == "restore" ? std::max(timeout_s, 25.0) : timeout_s;
    auto reply = control::call(ep, req, static_cast<int>(wait_s * 1000));
    if (!reply.ok()) {
      std::fprintf(stderr, "kvtd ctl: rank %u: %s\n", r, reply.error().message.c_str());
      all_replies.push_back({{"rank", r}, {"ok", false}, {"error", reply.error().message}});
      code = 1;
      continue;
    }
    json j = json::parse(*reply, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("ok")) {
      std::fprintf(stderr, "kvtd ctl: rank %u: the reply is not kvtd's JSON\n", r);
      code = 1;
      continue;
    }
    j["rank"] = r;
    all_replies.push_back(j);
    if (!j["ok"].get<bool>()) {
      std::fprintf(stderr, "kvtd ctl: rank %u refused: %s\n", r, j.value("error", std::string("?")).c_str());
      code = 1;
      continue;
    }
    if (as_json) continue;
    if (command == "status") print_status(r, j["result"]);
    else if (command == "drain") std::printf("rank %u: draining (finishes the tasks in flight, then exits)\n", r);
    else if (command == "clear") std::printf("rank %u: cache cleared (mappings closed%s)\n", r, drop_host_tier ? ", host tier dropped" : "");
    else if (command == "restore") std::printf("rank %u: cache restored (registry re-read and re-opened)\n", r);
    else std::printf("rank %u: log level %s\n", r, level.c_str());
  }
  if (as_json) std::printf("%s\n", all_replies.dump(2).c_str());
  return code;
}

}  // namespace kvtd::ctl
