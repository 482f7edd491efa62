// `kvtd ctl`: asks running daemons what they are doing, over their control sockets.
//
//   kvtd ctl [--session S] [--dp D] [--rank R | --all] [--endpoint E] [--timeout SEC] [--json]
//            status | drain | log-level LEVEL | clear [--drop-host-tier] | restore |
//            storage gc --keep-weight-version N [--keep-model M]... [--max-seconds S] [--dry-run]
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
#include <optional>
#include <string>
#include <vector>
#include <cstdio>
#include <fmt/format.h>
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

// "file store /x (by_head 2 per object, layout 0123...)": the backend and, with a store, the
// namespace its objects go to. A daemon of cache groups has a namespace per group, on the
// groups' lines (print_status), and no layout of its own here.
std::string storage_line(const json& st) {
  std::string out = st["backend"].get<std::string>();
  if (!st.contains("objects")) return out;
  out += " (" + st["objects"].get<std::string>();
  if (!st.contains("layout_fingerprint")) return out + ": each group's layout below)";
  if (st.contains("heads_per_object")) out += fmt::format(" {} per object", st["heads_per_object"].get<unsigned>());
  return out + ", layout " + st["layout_fingerprint"].get<std::string>() + ")";
}

// One readable line per rank for `status`.
void print_status(std::uint32_t rank, const json& r) {
  std::uint64_t ok = 0, failed = 0;
  for (const auto& t : r["tasks"]) (t["status"] == "ok" ? ok : failed) += t["count"].get<std::uint64_t>();
  const auto& errors = r["last_errors"];
  std::printf("rank %-3u %-9s epoch %-4u pid %-7lld tasks %llu ok %llu failed  to host %s  to device %s  queue %llu B  "
              "host pool %s (%s pinned in %.2f s)  storage %s%s%s\n",
              rank, r["attached"].get<bool>() ? "attached" : "waiting", r["epoch"].get<unsigned>(),
              r["pid"].get<long long>(), static_cast<unsigned long long>(ok), static_cast<unsigned long long>(failed),
              gb(r["bytes"]["to_host"].get<std::uint64_t>()).c_str(),
              gb(r["bytes"]["to_device"].get<std::uint64_t>()).c_str(),
              static_cast<unsigned long long>(r["queue_depth_bytes"].get<std::uint64_t>()),
              gb(r["host_pool_bytes"].get<std::uint64_t>()).c_str(),
              gb(r.value("host_pool_pinned_bytes", std::uint64_t{0})).c_str(),
              static_cast<double>(r.value("host_pool_pin_ms", std::uint64_t{0})) / 1000.0,
              storage_line(r["storage"]).c_str(),
              r["draining"].get<bool>() ? "  DRAINING" : (r.value("cache", "") == "cleared" ? "  CACHE CLEARED" : ""),
              errors.empty() ? "" : ("\n         last error: " + errors.back().get<std::string>()).c_str());
  for (const auto& g : r.value("cache_groups", json::array()))  // a cache of several groups: one line each
    std::printf("         group %u %-14s %3u layers  %lld device / %u host blocks of %s  host pool %s  to host %s  "
                "to device %s  stored read %s written %s%s\n",
                g["group"].get<unsigned>(), g["kind"].get<std::string>().c_str(), g["layers"].get<unsigned>(),
                g["device_blocks"].get<long long>(), g["host_blocks"].get<unsigned>(),
                gb(g["block_bytes"].get<std::uint64_t>()).c_str(), gb(g["host_pool_bytes"].get<std::uint64_t>()).c_str(),
                gb(g["bytes_to_host"].get<std::uint64_t>()).c_str(), gb(g["bytes_to_device"].get<std::uint64_t>()).c_str(),
                gb(g.value("storage_bytes_read", std::uint64_t{0})).c_str(),
                gb(g.value("storage_bytes_written", std::uint64_t{0})).c_str(),
                g.contains("layout_fingerprint")
                    ? ("  layout " + g["layout_fingerprint"].get<std::string>() + " " + g.value("stored", "")).c_str()
                    : "");
}

// One line per rank for `storage gc`.
void print_gc(std::uint32_t rank, const json& r) {
  if (r.contains("skipped")) {
    std::printf("rank %u: %s\n", rank, r["skipped"].get<std::string>().c_str());
    return;
  }
  std::printf("rank %u: %s %llu objects (%s) of %llu examined, %llu kept, %llu failed%s\n", rank,
              r["dry_run"].get<bool>() ? "would remove" : "removed",
              static_cast<unsigned long long>(r["removed"].get<std::uint64_t>()),
              gb(r["removed_bytes"].get<std::uint64_t>()).c_str(),
              static_cast<unsigned long long>(r["examined"].get<std::uint64_t>()),
              static_cast<unsigned long long>(r["kept"].get<std::uint64_t>()),
              static_cast<unsigned long long>(r["failed"].get<std::uint64_t>()),
              r["complete"].get<bool>() ? "" : "; stopped at --max-seconds: run it again to go on");
}

}  // namespace

namespace {

struct CtlArgs {
  std::string session, endpoint, command, level, secret_file;
  control::Request::StorageGc gc;
  std::vector<std::string> keep_models;
  std::optional<std::uint64_t> keep_weight_version;
  std::uint32_t dp = 0;
  std::int64_t rank = -1;
  bool all = false, as_json = false, drop_host_tier = false;
  double timeout_s = 2.0;
};

int fail(const std::string& message, int code = kExitBadFlags) {
  std::fprintf(stderr, "kvtd ctl: %s\n", message.c_str());
  return code;
}

// The request the arguments ask for, checked as the daemon will check it; else the exit code.
std::optional<int> make_request(const CtlArgs& a, control::Request* req) {
  req->command = a.command;
  req->level = a.level;
  if (a.command == "storage") {  // `kvtd ctl storage gc ...`
    if (a.level != "gc") return fail("storage: the one subcommand is gc (kvtd ctl storage gc --keep-weight-version N)");
    if (!a.keep_weight_version) return fail("storage gc needs --keep-weight-version (the engine's current weight version)");
    req->command = "storage-gc";
    req->level.clear();
    req->gc = a.gc;
    req->gc.keep_weight_version = *a.keep_weight_version;
    req->gc.keep_models = a.keep_models;
  }
  req->drop_host_tier = a.drop_host_tier;
  if (!a.secret_file.empty()) {
    auto secret = control::read_secret_file(a.secret_file);
    if (!secret.ok()) return fail(secret.error().message);
    req->token = std::move(secret).value();
  }
  if (auto checked = control::parse_request(control::request_text(*req)); !checked.ok())
    return fail(checked.error().message);
  if (!(a.timeout_s > 0 && a.timeout_s <= 600)) return fail("--timeout must be in (0, 600] seconds");
  if (a.rank >= 0 && a.all) return fail("--rank and --all exclude each other");
  return std::nullopt;
}

// The daemons to ask: one endpoint, one rank's socket, or every socket of the session; else the
// exit code.
std::optional<int> find_targets(const CtlArgs& a, std::vector<std::pair<std::uint32_t, std::string>>* targets) {
  if (!a.endpoint.empty()) {
    targets->emplace_back(a.rank >= 0 ? static_cast<std::uint32_t>(a.rank) : 0, a.endpoint);
    return std::nullopt;
  }
  if (a.session.empty()) return fail("--session (the daemons' --session / --ipc_suffix) or --endpoint is required");
  auto dir = control::runtime_dir();
  if (!dir.ok()) return fail(dir.error().message, 1);
  if (a.rank >= 0) {
    targets->emplace_back(static_cast<std::uint32_t>(a.rank),
                          "ipc://" + control::socket_path(*dir, a.session, a.dp, static_cast<std::uint32_t>(a.rank)));
    return std::nullopt;
  }
  for (auto& [r, path] : control::find_sockets(*dir, a.session, a.dp)) targets->emplace_back(r, "ipc://" + path);
  if (targets->empty())
    return fail(fmt::format("no daemon of session '{}' (dp {}) has a control socket in {}", a.session, a.dp, *dir), 1);
  return std::nullopt;
}

// Asks one daemon and prints its answer (unless --json): true when it answered ok.
bool ask(const CtlArgs& a, const control::Request& req, std::uint32_t r, const std::string& ep, json* replies) {
  // A clear waits for the tasks in flight: the daemon answers within 20 s, so wait longer.
  // A collection runs up to --max-seconds.
  const double wait_s = a.command == "clear" || a.command == "restore" ? std::max(a.timeout_s, 25.0)
                        : a.command == "storage"                       ? std::max(a.timeout_s, req.gc.max_seconds + 5)
                                                                       : a.timeout_s;
  auto reply = control::call(ep, req, static_cast<int>(wait_s * 1000));
  if (!reply.ok()) {
    std::fprintf(stderr, "kvtd ctl: rank %u: %s\n", r, reply.error().message.c_str());
    replies->push_back({{"rank", r}, {"ok", false}, {"error", reply.error().message}});
    return false;
  }
  json j = json::parse(*reply, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("ok")) {
    std::fprintf(stderr, "kvtd ctl: rank %u: the reply is not kvtd's JSON\n", r);
    return false;
  }
  j["rank"] = r;
  replies->push_back(j);
  if (!j["ok"].get<bool>()) {
    std::fprintf(stderr, "kvtd ctl: rank %u refused: %s\n", r, j.value("error", std::string("?")).c_str());
    return false;
  }
  if (a.as_json) return true;
  if (a.command == "status") print_status(r, j["result"]);
  else if (a.command == "drain") std::printf("rank %u: draining (finishes the tasks in flight, then exits)\n", r);
  else if (a.command == "clear") std::printf("rank %u: cache cleared (mappings closed%s)\n", r, a.drop_host_tier ? ", host tier dropped" : "");
  else if (a.command == "restore") std::printf("rank %u: cache restored (registry re-read and re-opened)\n", r);
  else if (a.command == "storage") print_gc(r, j["result"]);
  else std::printf("rank %u: log level %s\n", r, a.level.c_str());
  return true;
}

}  // namespace

int run_ctl(int argc, char** argv) {
  CLI::App app{"kvtd ctl - ask running kvtd daemons (status, drain, log-level, clear, restore, storage gc)", "kvtd ctl"};
  CtlArgs a;
  app.add_option("--session,--ipc_suffix", a.session, "Session suffix of the daemons (required unless --endpoint)");
  app.add_option("--dp,--local_data_parallel_id", a.dp, "Data-parallel group (default 0)");
  app.add_option("--rank", a.rank, "Only this rank");
  app.add_flag("--all", a.all, "Every rank of the session found in the runtime directory (the default)");
  app.add_option("--endpoint", a.endpoint, "One daemon by endpoint (ipc://... or tcp://127.0.0.1:port)");
  app.add_option("--secret-file", a.secret_file, "tcp:// endpoints: the daemon's --control-secret-file");
  app.add_option("--timeout", a.timeout_s, "Seconds to wait for each daemon (default 2)");
  app.add_flag("--json", a.as_json, "Print the daemons' JSON replies");
  app.add_flag("--drop-host-tier", a.drop_host_tier, "clear: also invalidate the host pool (its KV is the old weights')");
  app.add_option("--keep-weight-version", a.keep_weight_version,
                 "storage gc: the weight version to keep (objects of every other one are removed)");
  app.add_option("--keep-model", a.keep_models,
                 "storage gc: a model whose objects stay (repeat); when given, every other model's objects go");
  app.add_option("--max-seconds", a.gc.max_seconds, "storage gc: stop after this long (default 30; run again to go on)");
  app.add_flag("--dry-run", a.gc.dry_run, "storage gc: count what would be removed, remove nothing");
  app.add_option("command", a.command, "status | drain | log-level | clear | restore | storage")->required();
  app.add_option("level", a.level, "log-level: trace | debug | info | warn | error | critical | off; storage: gc");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitBadFlags;
  }
  control::Request req;
  if (auto code = make_request(a, &req)) return *code;
  std::vector<std::pair<std::uint32_t, std::string>> targets;
  if (auto code = find_targets(a, &targets)) return *code;
  int code = 0;
  json replies = json::array();
  for (const auto& [r, ep] : targets)
    if (!ask(a, req, r, ep, &replies)) code = 1;
  if (a.as_json) std::printf("%s\n", replies.dump(2).c_str());
  return code;
}

}  // namespace kvtd::ctl
