// kvtd/metrics/http_server.h - serves MetricsRegistry::render() as Prometheus text over HTTP,
// and the daemon's health probes (Boost.Beast; Asio stays in the .cpp).
//
// GET /metrics answers 200 with the exposition; GET /healthz and /readyz answer the health
// routes' JSON, 200 when ok and 503 when not (Kubernetes probes and load balancers read the
// status; people read the body); any other path 404, any other method 405; a
// request over 8 KiB or malformed is answered 400 (when possible) and the connection closed:
// nothing a client sends can crash or stall the server: connections are served concurrently (at
// most 64 at once, a newcomer beyond that is closed), each within 5 s in all and 2 s idle
// between keep-alive requests, so a silent, slow or non-reading client delays no other scrape.
//
// Ownership: borrows the registry, which must outlive the server. Not copyable or movable.
// Thread-safety: start() once; the destructor stops and joins the serving thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kvtd/metrics/registry.h"
#include "kvtd/proto/expected.h"

namespace kvtd::metrics {

enum class MetricsErrc { kBind };

// One health answer: whether it is ok, and a JSON object saying why.
struct HealthAnswer {
  bool ok = false;
  std::string json;
};
// /healthz (the process alive, its loop turning) and /readyz (it can serve). Called on the
// server's thread for every probe: they must answer from memory, never wait on I/O. Unset: 404.
struct HealthRoutes {
  std::function<HealthAnswer()> live;
  std::function<HealthAnswer()> ready;
};

class MetricsServer {
 public:
  // Listens on address:port (port 0: an ephemeral port, see port()); `address` is an IPv4
  // address (127.0.0.1: this host only; 0.0.0.0: every interface, for probes from a kubelet).
  static Result<std::unique_ptr<MetricsServer>, MetricsErrc> start(const MetricsRegistry& registry,
                                                                   std::uint16_t port, HealthRoutes health = {},
                                                                   const std::string& address = "127.0.0.1");
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  std::uint16_t port() const;

 private:
  struct Impl;
  explicit MetricsServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtd::metrics
