#include "kvtd/metrics/http_server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

namespace kvtd::metrics {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

// Connections are served concurrently on one io_context thread, each with a total deadline and
// an idle limit between keep-alive requests, and at most kMaxConnections at once. A newcomer
// beyond that takes the place of the connection that has waited longest for a request (slow or
// silent clients), so a client that holds its connection, sends half a request or reads nothing
// delays nobody else's scrape, and a kubelet's /healthz is answered under a flood of them (it
// was refused once 64 were held). Only when every connection is mid-answer is the newcomer closed.
constexpr int kMaxConnections = 64;
// After a failed accept (out of descriptors) the next waits this long: no busy loop meanwhile.
constexpr auto kAcceptRetry = std::chrono::milliseconds(100);
constexpr auto kConnectionDeadline = std::chrono::seconds(5);  // one connection, all its requests
constexpr auto kIdleDeadline = std::chrono::seconds(2);        // waiting for the next request

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(tcp::socket socket, const MetricsRegistry& registry, const HealthRoutes& health, std::atomic<int>& open)
      : stream_(std::move(socket)), registry_(registry), health_(health), open_(open),
        end_(std::chrono::steady_clock::now() + kConnectionDeadline) {}
  ~Connection() { open_.fetch_sub(1); }

  // Waiting for (the rest of) a request, since when: such a connection may be evicted.
  bool waiting() const { return waiting_; }
  std::chrono::steady_clock::time_point waiting_since() const { return waiting_since_; }
  // Closes it for a newcomer; its pending read ends with operation_aborted.
  void evict() { close(); }

  void read() {
    waiting_ = true;
    waiting_since_ = std::chrono::steady_clock::now();
    parser_.emplace();
    parser_->header_limit(8192);
    parser_->body_limit(8192);
    stream_.expires_at(std::min(end_, std::chrono::steady_clock::now() + kIdleDeadline));
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, std::size_t) { self->answer(ec); });
  }

 private:
  void answer(beast::error_code ec) {
    waiting_ = false;
    if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == asio::error::operation_aborted)
      return close();
    auto res = std::make_shared<http::response<http::string_body>>();
    res->version(11);
    res->set(http::field::server, "kvtd");
    bool keep_alive = false;
    bool json = false;
    if (ec) {
      res->result(http::status::bad_request);
      res->body() = "bad request: " + ec.message() + "\n";
    } else {
      const auto& req = parser_->get();
      keep_alive = req.keep_alive();
      if (req.method() != http::verb::get) {
        res->result(http::status::method_not_allowed);
        res->body() = "only GET\n";
      } else if (const auto* route = health_route(req.target()); route != nullptr && *route) {
        const HealthAnswer a = (*route)();
        res->result(a.ok ? http::status::ok : http::status::service_unavailable);
        res->body() = a.json + "\n";
        json = true;
      } else if (req.target() != "/metrics") {
        res->result(http::status::not_found);
        res->body() = "kvtd serves /metrics, /healthz and /readyz\n";
      } else {
        res->result(http::status::ok);
        res->body() = registry_.render();
      }
    }
    res->set(http::field::content_type, json                                 ? "application/json"
                                        : res->result() == http::status::ok ? "text/plain; version=0.0.4; charset=utf-8"
                                                                             : "text/plain; charset=utf-8");
    res->keep_alive(keep_alive);
    res->prepare_payload();
    const bool again = keep_alive && !ec;
    stream_.expires_at(end_);
    http::async_write(stream_, *res, [self = shared_from_this(), res, again](beast::error_code wec, std::size_t) {
      if (wec || !again) return self->close();
      self->read();
    });
  }

  const std::function<HealthAnswer()>* health_route(beast::string_view target) const {
    if (target == "/healthz") return &health_.live;
    if (target == "/readyz") return &health_.ready;
    return nullptr;
  }

  void close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{8192};
  std::optional<http::request_parser<http::string_body>> parser_;
  const MetricsRegistry& registry_;
  const HealthRoutes& health_;
  std::atomic<int>& open_;
  const std::chrono::steady_clock::time_point end_;
  bool waiting_ = false;  // io thread only
  std::chrono::steady_clock::time_point waiting_since_{};
};

struct MetricsServer::Impl {
  const MetricsRegistry& registry;
  HealthRoutes health;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread thread;
  std::atomic<int> open{0};
  std::uint16_t port = 0;
  std::vector<std::weak_ptr<Connection>> live;  // io thread only; pruned as connections end
  asio::steady_timer retry{io};

  Impl(const MetricsRegistry& r, HealthRoutes h) : registry(r), health(std::move(h)) {}

  // At the cap: evicts the connection that has waited longest for a request. False when every
  // connection is busy answering.
  bool make_room() {
    std::erase_if(live, [](const std::weak_ptr<Connection>& w) { return w.expired(); });
    std::shared_ptr<Connection> victim;
    for (const auto& w : live) {
      auto c = w.lock();
      if (c && c->waiting() && (!victim || c->waiting_since() < victim->waiting_since())) victim = c;
    }
    if (!victim) return false;
    victim->evict();
    std::erase_if(live, [&](const std::weak_ptr<Connection>& w) { return w.lock() == victim; });
    return true;
  }

  void accept() {
    acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
      if (ec == asio::error::operation_aborted) return;  // stopping
      if (ec) {
        // Out of descriptors (or another failure of this accept): try again a little later.
        retry.expires_after(kAcceptRetry);
        retry.async_wait([this](beast::error_code wec) {
          if (wec != asio::error::operation_aborted) accept();
        });
        return;
      }
      std::erase_if(live, [](const std::weak_ptr<Connection>& w) { return w.expired(); });
      if (live.size() >= static_cast<std::size_t>(kMaxConnections) && !make_room()) {
        beast::error_code ignored;
        socket.close(ignored);  // every connection is answering: the newcomer's client retries
      } else {
        open.fetch_add(1);
        auto c = std::make_shared<Connection>(std::move(socket), registry, health, open);
        live.push_back(c);
        c->read();
      }
      accept();
    });
  }

  void loop() {
    for (;;) {
      try {
        io.run();
        return;  // stopped
      } catch (const std::exception&) {
        // A client that breaks the protocol ends its connection, never the server.
      }
    }
  }
};

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<MetricsServer>, MetricsErrc> MetricsServer::start(const MetricsRegistry& registry,
                                                                        std::uint16_t port, HealthRoutes health,
                                                                        const std::string& address) {
  auto impl = std::make_unique<Impl>(registry, std::move(health));
  beast::error_code ec;
  const auto ip = asio::ip::make_address_v4(address, ec);
  if (ec) return make_error(MetricsErrc::kBind, "--metrics-address '" + address + "' is not an IPv4 address");
  const tcp::endpoint ep(ip, port);
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    return make_error(MetricsErrc::kBind,
                      fmt::format("--metrics-port {}: cannot listen on {}:{}: {}", port, address, port, ec.message()));
  impl->port = impl->acceptor.local_endpoint(ec).port();
  auto* raw = impl.get();
  raw->accept();
  raw->thread = std::thread([raw] { raw->loop(); });
  return std::unique_ptr<MetricsServer>(new MetricsServer(std::move(impl)));
}

MetricsServer::~MetricsServer() {
  impl_->io.stop();  // thread-safe: run() returns; pending connections end with the io_context
  if (impl_->thread.joinable()) impl_->thread.join();
  beast::error_code ec;
  impl_->acceptor.close(ec);
}

std::uint16_t MetricsServer::port() const { return impl_->port; }

}  // namespace kvtd::metrics
