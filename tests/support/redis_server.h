// redis_server.h - a real redis-server child on loopback for tests (no mocks), and a port range
// per test process.
#pragma once

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "test_support.h"

namespace kvtd::test {

// Ports and Redis Cluster bus ports (port + 10000) both below 32768, the start of Linux's
// ephemeral range: a bus port in that range met EADDRINUSE in about 1 run in 4.
inline int base_port() {
  static const int p = 10000 + static_cast<int>(::getpid() % 1500) * 8;  // <= 21999; bus <= 31999
  return p;
}

// A redis-server child on 127.0.0.1:port; killed with the test.
class RedisServer {
 public:
  RedisServer(int port, std::vector<std::string> extra, const std::string& dir) : port_(port), dir_(dir) {
    std::filesystem::create_directories(dir);
    args_ = {"/usr/bin/redis-server", "--port", std::to_string(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", dir, "--protected-mode", "no"};
    args_.insert(args_.end(), extra.begin(), extra.end());
    start();
  }
  void start() {
    using namespace std::chrono_literals;
    proc_ = Child(args_, fmt::format("{}/redis-{}.log", dir_, port_));
    ready_ = eventually([&] { return ping(); }, 10s);
  }
  void kill9() {
    proc_.signal(SIGKILL);
    proc_.wait_exit(std::chrono::seconds(5));
  }
  void freeze() { proc_.signal(SIGSTOP); }
  void thaw() { proc_.signal(SIGCONT); }
  bool ready() const { return ready_; }
  int port() const { return port_; }
  std::string endpoint() const { return fmt::format("127.0.0.1:{}", port_); }

  // Runs one command (argv) and returns the reply as text ("" on connection failure).
  std::string command(const std::vector<std::string>& argv, const std::string& password = "") const {
    timeval tv{2, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
    if (!c || c->err) {
      if (c) redisFree(c);
      return "";
    }
    if (!password.empty()) freeReplyObject(redisCommand(c, "AUTH %s", password.c_str()));
    std::vector<const char*> a;
    std::vector<size_t> l;
    for (const auto& s : argv) {
      a.push_back(s.data());
      l.push_back(s.size());
    }
    auto* r = static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(a.size()), a.data(), l.data()));
    std::string out;
    if (r) {
      if (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR)
        out.assign(r->str, r->len);
      else if (r->type == REDIS_REPLY_INTEGER)
        out = std::to_string(r->integer);
      freeReplyObject(r);
    }
    redisFree(c);
    return out;
  }

 private:
  bool ping() const {
    const auto r = command({"PING"});
    return r == "PONG" || r.find("NOAUTH") != std::string::npos;
  }
  int port_;
  std::string dir_;
  std::vector<std::string> args_;
  Child proc_;
  bool ready_ = false;
};

}  // namespace kvtd::test
