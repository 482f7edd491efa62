// kvtd/control/control.h - the daemon's control plane: a ZeroMQ REP socket per daemon taking
// JSON requests ({"command": "status" | "drain" | "log-level" | "clear" | "restore", "level": ...,
// "drop_host_tier": bool}) and answering
// JSON ({"ok": true, "result": {...}} or {"ok": false, "error": "..."}), and the client side that
// `kvtd ctl` uses.
//
// Where: ipc://<runtime dir>/kvtd_<uid>_<session>_dp<d>_r<rank>.sock, the runtime dir being
// $RUNTIME_DIRECTORY (systemd's RuntimeDirectory=), else /run/kvtd when it is ours (the unit's
// directory, seen from `kvtd ctl` run as the same user), else $XDG_RUNTIME_DIR/kvtd, else
// /tmp/kvtd-<uid>; it must be a directory owned by this user with mode 0700 (made so when
// missing, refused otherwise). Optionally also a TCP endpoint on loopback (--control-endpoint),
// on a socket of its own that answers only requests carrying the shared secret ("token", from
// --control-secret-file: loopback is open to every local user, the ipc socket is not).
//
// Hostile input: a request over 64 KiB is dropped by ZeroMQ (ZMQ_MAXMSGSIZE); anything that is
// not a JSON object with a known command gets an error reply; the socket always answers.
//
// Ownership: ControlServer owns its thread and sockets; the handler it calls must stay valid
// until it is destroyed. Thread-safety: the handler runs on the server's thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvtd/proto/expected.h"

namespace kvtd::control {

enum class ControlErrc { kInvalidArgument, kRuntimeDir, kBind, kInUse, kTimeout, kBadReply };

inline constexpr const char* kCommandList = "status, drain, log-level, clear, restore or storage-gc";

struct Request {
  std::string command;  // kCommandList
  std::string level;    // log-level: trace | debug | info | warn | error | critical | off
  bool drop_host_tier = false;  // clear: also invalidate the host pool
  std::string token;            // the TCP endpoint's shared secret (ignored on the ipc socket)
  // storage-gc: remove stored objects of other weight versions (keep_weight_version: the
  // engine's, required), other layouts of this model, and, when keep_models is non-empty, of
  // every model it does not name; for at most max_seconds; dry_run: count only.
  struct StorageGc {
    std::uint64_t keep_weight_version = 0;
    std::vector<std::string> keep_models;
    double max_seconds = 30;
    bool dry_run = false;
  } gc;
};

// The request as the daemon parses it (parse_request(request_text(r)) gives r back).
std::string request_text(const Request& request);

// The shared secret in `path`: its first line, at least 16 characters, in a regular file owned by
// this user that no one else may read (mode 0600-like). The error names the path and the problem.
Result<std::string, ControlErrc> read_secret_file(const std::string& path);

// What the handler answers: `result_json` (a JSON object's text) when ok, else `error`. Work
// that may take long (storage gc: up to an hour) comes back as `later`: the server runs it on a
// thread of its own, beside the control loop (a `status` meanwhile is answered at once), and
// sends its reply when it ends; one such job runs at a time, another is refused as busy.
struct Reply {
  bool ok = true;
  std::string result_json = "{}";
  std::string error;
  std::function<Reply()> later;
};

using Handler = std::function<Reply(const Request&)>;

// The runtime directory (checked or made 0700, owned by us), or an error naming the problem.
Result<std::string, ControlErrc> runtime_dir();
// The socket path of (session, data-parallel id, rank) in `dir`.
std::string socket_path(const std::string& dir, const std::string& session, std::uint32_t dp, std::uint32_t rank);
// Every daemon socket of `session` and `dp` in `dir`, by rank.
std::vector<std::pair<std::uint32_t, std::string>> find_sockets(const std::string& dir, const std::string& session,
                                                                std::uint32_t dp);

class ControlServer {
 public:
  // Binds ipc://<socket_path> (replacing a stale socket file; kInUse when a live process still
  // listens on it, e.g. the rank's running daemon) and, if not empty, `tcp_endpoint` (must be
  // tcp://127.0.0.1:<port> or tcp://localhost:<port>), which needs `tcp_secret` (refused without).
  static Result<std::unique_ptr<ControlServer>, ControlErrc> start(const std::string& socket_path,
                                                                   const std::string& tcp_endpoint,
                                                                   const std::string& tcp_secret, Handler handler);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;
  const std::string& endpoint() const;

 private:
  struct Impl;
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Client: sends one request to `endpoint` (ipc://... or tcp://...) and returns the reply's JSON
// text, or kTimeout when nothing answered within timeout_ms.
Result<std::string, ControlErrc> call(const std::string& endpoint, const Request& request, int timeout_ms);

// Parses a request's JSON text (exposed for tests and fuzzing).
Result<Request, ControlErrc> parse_request(const std::string& text);

}  // namespace kvtd::control
