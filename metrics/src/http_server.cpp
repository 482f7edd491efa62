#include "kvtd/metrics/http_server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <poll.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace kvtd::metrics {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

struct MetricsServer::Impl {
  const MetricsRegistry& registry;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread thread;
  std::atomic<bool> stopping{false};
  std::uint16_t port = 0;

  explicit Impl(const MetricsRegistry& r) : registry(r) {}

  // One connection: requests until the client closes, an error, or the deadline. Asynchronous
  // operations run to completion on this thread's io_context, because only those honour the
  // stream's expiry: a client that sends nothing (or reads nothing) is cut off after 2 s.
  void serve(tcp::socket socket) {
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer(8192);
    for (;;) {
      http::request_parser<http::string_body> parser;
      parser.header_limit(8192);
      parser.body_limit(8192);
      beast::error_code ec;
      stream.expires_after(std::chrono::seconds(2));
      http::async_read(stream, buffer, parser, [&ec](beast::error_code e, std::size_t) { ec = e; });
      io.restart();
      io.run();
      if (ec == http::error::end_of_stream || ec == beast::error::timeout) break;
      http::response<http::string_body> res;
      res.version(11);
      res.set(http::field::server, "kvtd");
      bool keep_alive = false;
      if (ec) {
        res.result(http::status::bad_request);
        res.body() = "bad request: " + ec.message() + "\n";
      } else {
        const auto& req = parser.get();
        keep_alive = req.keep_alive();
        if (req.method() != http::verb::get) {
          res.result(http::status::method_not_allowed);
          res.body() = "only GET\n";
        } else if (req.target() != "/metrics") {
          res.result(http::status::not_found);
          res.body() = "kvtd serves /metrics\n";
        } else {
          res.result(http::status::ok);
          res.body() = registry.render();
        }
      }
      res.set(http::field::content_type, res.result() == http::status::ok ? "text/plain; version=0.0.4; charset=utf-8"
                                                                          : "text/plain; charset=utf-8");
      res.keep_alive(keep_alive);
      res.prepare_payload();
      beast::error_code wec;
      stream.expires_after(std::chrono::seconds(2));
      http::async_write(stream, res, [&wec](beast::error_code e, std::size_t) { wec = e; });
      io.restart();
      io.run();
      if (wec || !keep_alive || ec) break;
    }
    beast::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
  }

  // Only this thread touches the acceptor after start(): it polls with a short timeout, so the
  // destructor stops it by setting `stopping` (no cross-thread close of a blocked accept).
  void loop() {
    while (!stopping.load()) {
      pollfd pfd{acceptor.native_handle(), POLLIN, 0};
      if (::poll(&pfd, 1, 100) <= 0) continue;
      beast::error_code ec;
      tcp::socket socket(io);
      acceptor.accept(socket, ec);
      if (ec) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));  // e.g. out of descriptors
        continue;
      }
      try {
        serve(std::move(socket));
      } catch (const std::exception&) {
        // A client that breaks the protocol ends its connection, never the server.
      }
    }
  }
};

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<MetricsServer>, MetricsErrc> MetricsServer::start(const MetricsRegistry& registry,
                                                                        std::uint16_t port) {
  auto impl = std::make_unique<Impl>(registry);
  beast::error_code ec;
  const tcp::endpoint ep(asio::ip::make_address_v4("127.0.0.1"), port);
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    return make_error(MetricsErrc::kBind, "--metrics-port " + std::to_string(port) + ": cannot listen on 127.0.0.1:" +
                                              std::to_string(port) + ": " + ec.message());
  impl->port = impl->acceptor.local_endpoint(ec).port();
  auto* raw = impl.get();
  raw->thread = std::thread([raw] { raw->loop(); });
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::~MetricsServer() {
  impl_->stopping.store(true);
  if (impl_->thread.joinable()) impl_->thread.join();  // within one poll timeout or one connection
  beast::error_code ec;
  impl_->acceptor.close(ec);
}

std::uint16_t MetricsServer::port() const { return impl_->port; }

}  // namespace kvtd::metrics
