#include "kvtd/base/log_levels.h"
#include "kvtd/control/control.h"
#include "kvtd/proto/names.h"

#include "kvtd/config/daemon_config.h"
#include "kvtd/base/mutex.h"
#include "kvtd/listeners/zmq_listener_guard.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <zmq.hpp>

namespace kvtd::control {
namespace {

using json = nlohmann::json;

constexpr std::int64_t kMaxRequestBytes = 64 * 1024;
// The TCP endpoint's connections open at once: more and the oldest is shut down (an operator's
// request takes milliseconds, so a flood of idle connections cannot keep it out).
constexpr std::size_t kMaxTcpConnections = 32;
constexpr int kTcpHandshakeMs = 2000;

std::string error_reply(const std::string& why) { return json{{"ok", false}, {"error", why}}.dump(); }

// A directory for sockets that only this user can reach: exists (or is made) 0700 and ours.
Result<std::string, ControlErrc> private_dir(const std::string& dir) {
  struct stat st {};
  if (lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT)
      return make_error(ControlErrc::kRuntimeDir, dir + ": " + std::strerror(errno));
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(dir).parent_path(), ec);
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
      return make_error(ControlErrc::kRuntimeDir, "cannot make " + dir + ": " + std::strerror(errno));
    if (lstat(dir.c_str(), &st) != 0) return make_error(ControlErrc::kRuntimeDir, dir + ": " + std::strerror(errno));
  }
  if (!S_ISDIR(st.st_mode)) return make_error(ControlErrc::kRuntimeDir, dir + " is not a directory");
  if (st.st_uid != getuid())
    return make_error(ControlErrc::kRuntimeDir, fmt::format("{} belongs to uid {}, not to us", dir, st.st_uid));
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%03o", st.st_mode & 0777);
    return make_error(ControlErrc::kRuntimeDir, dir + " has mode " + mode + "; control sockets need 0700");
  }
  return dir;
}

// True when a process accepts connections on the unix socket at `path` (a stale file refuses).
bool socket_is_live(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool live = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return live;
}

bool loopback_tcp(const std::string& e) {
  return e.rfind("tcp://127.0.0.1:", 0) == 0 || e.rfind("tcp://localhost:", 0) == 0;
}

}  // namespace

Result<std::string, ControlErrc> runtime_dir() {
  if (const char* d = std::getenv("RUNTIME_DIRECTORY"); d && *d) {
    std::string first(d);
    if (auto colon = first.find(':'); colon != std::string::npos) first.resize(colon);  // several: the first
    return private_dir(first);
  }
  // The systemd unit's RuntimeDirectory, seen from a shell of the same user (`kvtd ctl`).
  struct stat st {};
  if (lstat("/run/kvtd", &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == getuid()) return private_dir("/run/kvtd");
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x && *x) return private_dir(std::string(x) + "/kvtd");
  return private_dir(fmt::format("/tmp/kvtd-{}", getuid()));
}

std::string socket_path(const std::string& dir, const std::string& session, std::uint32_t dp, std::uint32_t rank) {
  return fmt::format("{}/kvtd_{}_{}_dp{}_r{}.sock", dir, getuid(), session, dp, rank);
}

std::vector<std::pair<std::uint32_t, std::string>> find_sockets(const std::string& dir, const std::string& session,
                                                                std::uint32_t dp) {
  std::vector<std::pair<std::uint32_t, std::string>> out;
  const std::string prefix = fmt::format("kvtd_{}_{}_dp{}_r", getuid(), session, dp);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || name.size() <= prefix.size() + 5 || name.substr(name.size() - 5) != ".sock")
      continue;
    const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - 5);
    if (digits.empty() || digits.size() > 2 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    out.emplace_back(static_cast<std::uint32_t>(std::stoul(digits)), e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

Error<ControlErrc> bad_gc(const std::string& why) { return make_error(ControlErrc::kInvalidArgument, "storage-gc: " + why); }

Status<ControlErrc> parse_storage_gc(const json& j, Request::StorageGc* gc) {
  const auto wv = j.find("keep_weight_version");
  if (wv == j.end() || !wv->is_number_unsigned())
    return bad_gc("needs \"keep_weight_version\", the engine's current weight version (an unsigned integer)");
  gc->keep_weight_version = wv->get<std::uint64_t>();
  if (const auto models = j.find("keep_models"); models != j.end()) {
    if (!models->is_array() || models->size() > 64) return bad_gc("\"keep_models\" must be an array of at most 64 model ids");
    for (const auto& m : *models) {
      if (!m.is_string() || !proto::valid_model_id(m.get<std::string>()))
        return bad_gc("\"keep_models\" holds something that is not a model id ([A-Za-z0-9_.-]{1,64})");
      gc->keep_models.push_back(m.get<std::string>());
    }
  }
  if (const auto s = j.find("max_seconds"); s != j.end()) {
    if (!s->is_number() || !(s->get<double>() > 0 && s->get<double>() <= 3600))
      return bad_gc("\"max_seconds\" must be a number in (0, 3600]");
    gc->max_seconds = s->get<double>();
  }
  if (const auto d = j.find("dry_run"); d != j.end()) {
    if (!d->is_boolean()) return bad_gc("\"dry_run\" must be a boolean");
    gc->dry_run = d->get<bool>();
  }
  return {};
}

}  // namespace

Result<Request, ControlErrc> parse_request(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return make_error(ControlErrc::kInvalidArgument, "the request is not valid JSON");
  if (!j.is_object()) return make_error(ControlErrc::kInvalidArgument, "the request must be a JSON object");
  const auto cmd = j.find("command");
  if (cmd == j.end() || !cmd->is_string())
    return make_error(ControlErrc::kInvalidArgument, std::string("the request needs \"command\": ") + kCommandList);
  Request r;
  r.command = cmd->get<std::string>();
  if (r.command != "status" && r.command != "drain" && r.command != "log-level" && r.command != "clear" &&
      r.command != "restore" && r.command != "storage-gc")
    return make_error(ControlErrc::kInvalidArgument, "unknown command '" + r.command.substr(0, 64) + "': " + kCommandList);
  if (const auto token = j.find("token"); token != j.end()) {
    if (!token->is_string()) return make_error(ControlErrc::kInvalidArgument, "\"token\" must be a string");
    r.token = token->get<std::string>();
  }
  if (const auto drop = j.find("drop_host_tier"); drop != j.end()) {
    if (r.command != "clear" || !drop->is_boolean())
      return make_error(ControlErrc::kInvalidArgument, "\"drop_host_tier\" is a boolean of the clear command");
    r.drop_host_tier = drop->get<bool>();
  }
  if (r.command == "storage-gc") KVTD_TRY(parse_storage_gc(j, &r.gc));
  if (r.command == "log-level") {
    const auto level = j.find("level");
    if (level == j.end() || !level->is_string())
      return make_error(ControlErrc::kInvalidArgument, "log-level needs \"level\"");
    r.level = level->get<std::string>();
    if (!kvtd::valid_log_level(r.level))
      return make_error(ControlErrc::kInvalidArgument,
                        "level '" + r.level.substr(0, 32) + "' is not one of " + kvtd::kLogLevelList);
  }
  return r;
}

Result<std::string, ControlErrc> read_secret_file(const std::string& path) {
  auto bad = [&](const std::string& why) {
    return make_error(ControlErrc::kInvalidArgument, "--control-secret-file " + path + ": " + why);
  };
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return bad(std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return bad("not a regular file (a symbolic link is refused)");
  if (st.st_uid != ::geteuid()) return bad(fmt::format("owned by uid {}, not this user", st.st_uid));
  if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return bad(std::string("mode ") + mode + " lets other users read the secret; chmod 600 " + path);
  }
  std::ifstream in(path);
  std::string secret;
  std::getline(in, secret);
  while (!secret.empty() && (secret.back() == '\r' || secret.back() == ' ')) secret.pop_back();
  if (secret.size() < 16) return bad("the secret (its first line) must have at least 16 characters");
  return secret;
}

namespace {

// Compares in time independent of where they differ (no timing oracle for the secret).
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

}  // namespace

struct ControlServer::Impl {
  zmq::context_t context{1};
  // ROUTER, not REP: the loop owns each request's envelope, so a malformed or abandoned request
  // costs only its sender. (libzmq 4.3.4's REP took the next request's routing frame as payload
  // once the sender of a malformed one had gone, and that request's reply was lost.)
  zmq::socket_t socket{context, zmq::socket_type::router};
  zmq::socket_t tcp{context, zmq::socket_type::router};  // bound only with a TCP endpoint
  bool has_tcp = false;
  std::string secret;
  std::string endpoint;
  std::string path;
  Handler handler;
  std::atomic<bool> stopping{false};
  std::thread thread;
  // Caps the TCP endpoint's connections (any local user can connect): destroyed before the
  // context, after the loop has stopped.
  std::unique_ptr<listeners::ZmqListenerGuard> tcp_guard;

  // The one long job running beside the loop (Reply::later): its client's routing id and socket,
  // and its reply once done (the loop sends it: ZeroMQ sockets are the loop thread's alone).
  struct Job {
    std::thread thread;
    zmq::socket_t* socket = nullptr;
    std::string routing_id;
    Mutex mu;
    std::optional<std::string> reply GUARDED_BY(mu);  // set by the job's thread
  };
  std::unique_ptr<Job> job;

  static std::string reply_text(const Reply& r) {
    if (!r.ok) return error_reply(r.error);
    json result = json::parse(r.result_json, nullptr, false);
    if (result.is_discarded()) return error_reply("internal error: the handler's result is not JSON");
    return json{{"ok", true}, {"result", result}}.dump();
  }

  // The reply to `text`, or nullopt when a job now runs beside the loop and answers later.
  std::optional<std::string> answer(const std::string& text, bool from_tcp, zmq::socket_t& s, const zmq::message_t& id) {
    auto req = parse_request(text);
    if (from_tcp && (!req.ok() || !same_secret(req->token, secret)))
      return error_reply("unauthorized: the TCP control endpoint answers only requests with the secret of "
                         "--control-secret-file");
    if (!req.ok()) return error_reply(req.error().message);
    Reply r;
    try {
      r = handler(*req);
    } catch (const std::exception& e) {
      return error_reply(std::string("internal error: ") + e.what());
    }
    if (!r.later) return reply_text(r);
    if (job) return error_reply("busy: another " + req->command + " or long request is running on this daemon");
    job = std::make_unique<Job>();
    job->socket = &s;
    job->routing_id.assign(static_cast<const char*>(id.data()), id.size());
    Job* j = job.get();
    j->thread = std::thread([j, work = std::move(r.later)] {
      std::string out;
      try {
        out = reply_text(work());
      } catch (const std::exception& e) {
        out = error_reply(std::string("internal error: ") + e.what());
      }
      MutexLock g(j->mu);
      j->reply = std::move(out);
    });
    return std::nullopt;
  }

  // Sends the long job's reply once it has one (loop thread).
  void finish_job(bool wait) {
    if (!job) return;
    {
      MutexLock g(job->mu);
      if (!job->reply && !wait) return;
    }
    job->thread.join();
    std::string reply;
    {
      MutexLock g(job->mu);
      reply = std::move(*job->reply);
    }
    try {
      job->socket->send(zmq::buffer(job->routing_id), zmq::send_flags::sndmore);
      job->socket->send(zmq::message_t{}, zmq::send_flags::sndmore);
      job->socket->send(zmq::buffer(reply), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      // the client has gone: nobody to tell
    }
    job.reset();
  }

  // One request on `s`, if one is waiting. A REQ client's request arrives as [routing id][empty
  // delimiter][request]; the reply goes back in the same envelope. A message without that
  // envelope has no address to answer: it is read whole and dropped. A reply to a peer that has
  // gone is dropped by the ROUTER, never delivered to another peer.
  void serve_one(zmq::socket_t& s, bool from_tcp) {
    zmq::message_t parts[3];
    std::size_t count = 0;
    zmq::message_t part;
    if (!s.recv(part, zmq::recv_flags::dontwait)) return;
    for (;;) {
      const bool more = part.more();
      if (count < 3) parts[count] = std::move(part);
      ++count;  // parts past the third are read and dropped: the message is taken whole
      if (!more) break;
      if (!s.recv(part, zmq::recv_flags::none)) return;
    }
    if (count < 3 || parts[1].size() != 0) return;  // not a REQ envelope
    const std::optional<std::string> reply =
        count > 3 ? error_reply("send the request as one message")
                  : answer(std::string(static_cast<const char*>(parts[2].data()), parts[2].size()), from_tcp, s,
                           parts[0]);
    if (!reply) return;  // a job beside the loop answers when it ends
    s.send(parts[0], zmq::send_flags::sndmore);
    s.send(zmq::message_t{}, zmq::send_flags::sndmore);
    s.send(zmq::buffer(*reply), zmq::send_flags::dontwait);
  }

  void loop() {
    while (!stopping.load()) {
      zmq::pollitem_t items[2] = {{socket.handle(), 0, ZMQ_POLLIN, 0}, {tcp.handle(), 0, ZMQ_POLLIN, 0}};
      try {
        finish_job(false);
        // A job running: look for its end every 20 ms; otherwise sleep until a request comes.
        if (zmq::poll(items, has_tcp ? 2 : 1, std::chrono::milliseconds(job ? 20 : 100)) <= 0) continue;
        if (items[0].revents & ZMQ_POLLIN) serve_one(socket, false);
        if (has_tcp && (items[1].revents & ZMQ_POLLIN)) serve_one(tcp, true);
      } catch (const zmq::error_t&) {
        // EINTR, or a peer gone mid-exchange: each request stands alone on the ROUTER.
      }
    }
  }
};

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<ControlServer>, ControlErrc> ControlServer::start(const std::string& path,
                                                                        const std::string& tcp_endpoint,
                                                                        const std::string& tcp_secret,
                                                                        Handler handler) {
  if (!tcp_endpoint.empty() && !loopback_tcp(tcp_endpoint))
    return make_error(ControlErrc::kInvalidArgument,
                      "--control-endpoint " + tcp_endpoint + ": only tcp://127.0.0.1:<port> or tcp://localhost:<port>");
  // Any local user can reach loopback: a TCP endpoint without a secret would let them stop the
  // daemon or clear the engine's cache.
  if (!tcp_endpoint.empty() && tcp_secret.size() < 16)
    return make_error(ControlErrc::kInvalidArgument, "--control-endpoint " + tcp_endpoint +
                                                         " needs --control-secret-file: any local user can reach a "
                                                         "TCP port (the ipc socket is private to this user)");
  auto impl = std::make_unique<Impl>();
  impl->secret = tcp_secret;
  impl->handler = std::move(handler);
  impl->path = path;
  impl->endpoint = "ipc://" + path;
  try {
    impl->socket.set(zmq::sockopt::maxmsgsize, kMaxRequestBytes);
    // Closing waits up to a second for replies still queued: the answer to `drain` must reach
    // the client although the daemon exits right after sending it.
    impl->socket.set(zmq::sockopt::linger, 1000);
    if (socket_is_live(path))
      return make_error(ControlErrc::kInUse, "control socket " + path + " is served by another live process");
    ::unlink(path.c_str());  // a socket file a killed daemon left: nobody listens on it
    impl->socket.bind(impl->endpoint);
    ::chmod(path.c_str(), 0600);
    if (!tcp_endpoint.empty()) {
      impl->tcp.set(zmq::sockopt::maxmsgsize, kMaxRequestBytes);
      impl->tcp.set(zmq::sockopt::linger, 1000);
      // A peer that does not finish ZeroMQ's greeting within this is dropped (libzmq: 30 s).
      impl->tcp.set(zmq::sockopt::handshake_ivl, kTcpHandshakeMs);
      impl->tcp.bind(tcp_endpoint);
      impl->has_tcp = true;
      auto guard = listeners::ZmqListenerGuard::start(
          impl->context.handle(), impl->tcp.handle(),
          {"control endpoint " + tcp_endpoint, kMaxTcpConnections, listeners::Evict::kOldest});
      if (!guard.ok()) return make_error(ControlErrc::kBind, guard.error().message);
      impl->tcp_guard = std::move(guard).value();
    }
  } catch (const zmq::error_t& e) {
    return make_error(ControlErrc::kBind, "control socket " + impl->endpoint +
                                              (tcp_endpoint.empty() ? "" : " / " + tcp_endpoint) + ": " + e.what());
  }
  auto* raw = impl.get();
  raw->thread = std::thread([raw] { raw->loop(); });
  return std::unique_ptr<ControlServer>(new ControlServer(std::move(impl)));
}

ControlServer::~ControlServer() {
  impl_->stopping.store(true);
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->finish_job(/*wait=*/true);  // a job still running ends (it is bounded) and is answered
  impl_->socket.close();
  impl_->tcp.close();
  ::unlink(impl_->path.c_str());
}

const std::string& ControlServer::endpoint() const { return impl_->endpoint; }

std::string request_text(const Request& request) {
  json j{{"command", request.command}};
  if (!request.level.empty()) j["level"] = request.level;
  if (request.drop_host_tier) j["drop_host_tier"] = true;
  if (!request.token.empty()) j["token"] = request.token;
  if (request.command == "storage-gc") {
    j["keep_weight_version"] = request.gc.keep_weight_version;
    if (!request.gc.keep_models.empty()) j["keep_models"] = request.gc.keep_models;
    j["max_seconds"] = request.gc.max_seconds;
    if (request.gc.dry_run) j["dry_run"] = true;
  }
  return j.dump();
}

Result<std::string, ControlErrc> call(const std::string& endpoint, const Request& request, int timeout_ms) {
  try {
    zmq::context_t context{1};
    zmq::socket_t socket{context, zmq::socket_type::req};
    socket.set(zmq::sockopt::linger, 0);
    socket.set(zmq::sockopt::rcvtimeo, timeout_ms);
    socket.set(zmq::sockopt::sndtimeo, timeout_ms);
    socket.connect(endpoint);
    if (!socket.send(zmq::buffer(request_text(request)), zmq::send_flags::none))
      return make_error(ControlErrc::kTimeout, "no daemon took the request at " + endpoint);
    zmq::message_t reply;
    if (!socket.recv(reply, zmq::recv_flags::none))
      return make_error(ControlErrc::kTimeout,
                        fmt::format("no daemon answered at {} within {} ms", endpoint, timeout_ms));
    return std::string(static_cast<const char*>(reply.data()), reply.size());
  } catch (const zmq::error_t& e) {
    return make_error(ControlErrc::kBadReply, endpoint + ": " + e.what());
  }
}

}  // namespace kvtd::control
