// kvtd/metrics/http_server.h - serves MetricsRegistry::render() as Prometheus text over HTTP on
// loopback (Boost.Beast; Asio stays in the .cpp).
//
// GET /metrics answers 200 with the exposition; any other path 404, any other method 405; a
// request over 8 KiB or malformed is answered 400 (when possible) and the connection closed:
// nothing a client sends can crash or stall the server: connections are served concurrently (at
// most 64 at once, a newcomer beyond that is closed), each within 5 s in all and 2 s idle
// between keep-alive requests, so a silent, slow or non-reading client delays no other scrape.
//
// Ownership: borrows the registry, which must outlive the server. Not copyable or movable.
// Thread-safety: start() once; the destructor stops and joins the serving thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kvtd/metrics/registry.h"
#include "kvtd/proto/expected.h"

namespace kvtd::metrics {

enum class MetricsErrc { kBind };

class MetricsServer {
 public:
  // Listens on 127.0.0.1:port (port 0: an ephemeral port, see port()).
  static Result<std::unique_ptr<MetricsServer>, MetricsErrc> start(const MetricsRegistry& registry,
                                                                   std::uint16_t port);
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
