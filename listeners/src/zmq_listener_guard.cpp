#include "kvtd/listeners/zmq_listener_guard.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "kvtd/base/mutex.h"

namespace kvtd::listeners {
namespace {

std::atomic<unsigned> g_next_monitor{0};

// The port of every tcp:// endpoint in ZeroMQ's "last endpoint" text (one per bind).
std::vector<std::uint16_t> tcp_ports(const std::string& last_endpoint) {
  std::vector<std::uint16_t> ports;
  if (last_endpoint.rfind("tcp://", 0) != 0) return ports;
  const auto colon = last_endpoint.rfind(':');
  if (colon == std::string::npos) return ports;
  const long p = std::strtol(last_endpoint.c_str() + colon + 1, nullptr, 10);
  if (p > 0 && p < 65536) ports.push_back(static_cast<std::uint16_t>(p));
  return ports;
}

// Whether `fd` is, right now, a connected (not listening) TCP socket on one of `ports`: only then
// is it one this listener accepted, whatever happened to the number since the event.
bool accepted_on(int fd, const std::vector<std::uint16_t>& ports) {
  int type = 0, listening = 0;
  socklen_t len = sizeof type;
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return false;
  len = sizeof listening;
  if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || listening != 0) return false;
  sockaddr_storage a{};
  len = sizeof a;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return false;
  std::uint16_t port = 0;
  if (a.ss_family == AF_INET) port = ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  else if (a.ss_family == AF_INET6) port = ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  else return false;
  return std::find(ports.begin(), ports.end(), port) != ports.end();
}

}  // namespace

struct ZmqListenerGuard::Impl {
  GuardOptions options;
  std::vector<std::uint16_t> ports;
  void* monitor = nullptr;  // PAIR socket, the guard thread's alone
  std::deque<int> open;     // accepted descriptors, oldest first (guard thread only)
  std::atomic<bool> stopping{false};
  std::thread thread;
  mutable Mutex mu;
  GuardStats stats GUARDED_BY(mu);

  void forget(int fd) {
    auto it = std::find(open.begin(), open.end(), fd);
    if (it != open.end()) open.erase(it);
  }

  void accepted(int fd) {
    forget(fd);  // a number reused after a close whose event is still queued
    open.push_back(fd);
    std::uint64_t shut = 0;
    while (open.size() > options.max_connections) {
      const int victim = options.evict == Evict::kOldest ? open.front() : open.back();
      if (options.evict == Evict::kOldest) open.pop_front();
      else open.pop_back();
      // libzmq sees the end of the stream and closes its side; its event then finds nothing here.
      if (accepted_on(victim, ports) && ::shutdown(victim, SHUT_RDWR) == 0) ++shut;
    }
    MutexLock g(mu);
    ++stats.accepted;
    stats.shut_down += shut;
    stats.open = open.size();
  }

  void loop() {
    while (!stopping.load(std::memory_order_acquire)) {
      zmq_pollitem_t item{monitor, 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 100) <= 0) continue;
      zmq_msg_t head, where;
      zmq_msg_init(&head);
      zmq_msg_init(&where);
      const bool got = zmq_msg_recv(&head, monitor, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&head) &&
                       zmq_msg_recv(&where, monitor, 0) >= 0;
      if (got && zmq_msg_size(&head) >= 6) {
        std::uint16_t event = 0;
        std::int32_t value = 0;
        std::memcpy(&event, zmq_msg_data(&head), 2);
        std::memcpy(&value, static_cast<const char*>(zmq_msg_data(&head)) + 2, 4);
        if (event == ZMQ_EVENT_ACCEPTED) {
          accepted(value);
        } else if (event == ZMQ_EVENT_DISCONNECTED || event == ZMQ_EVENT_CLOSED) {
          forget(value);
          MutexLock g(mu);
          stats.open = open.size();
        }
      }
      zmq_msg_close(&head);
      zmq_msg_close(&where);
    }
  }
};

Result<std::unique_ptr<ZmqListenerGuard>, ListenErrc> ZmqListenerGuard::start(void* context, void* socket,
                                                                             GuardOptions options) {
  if (options.max_connections == 0)
    return make_error(ListenErrc::kInvalidArgument, options.name + ": a connection cap of 0");
  auto impl = std::make_unique<Impl>();
  char last[256] = {0};
  size_t len = sizeof last - 1;
  if (zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, last, &len) != 0)
    return make_error(ListenErrc::kSystem, options.name + ": " + zmq_strerror(zmq_errno()));
  impl->ports = tcp_ports(last);
  if (impl->ports.empty()) return make_error(ListenErrc::kInvalidArgument, options.name + ": not bound to tcp://");
  impl->options = std::move(options);
  const std::string inproc = fmt::format("inproc://kvtd-listener-guard-{}", g_next_monitor.fetch_add(1));
  if (zmq_socket_monitor(socket, inproc.c_str(), ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CLOSED) != 0)
    return make_error(ListenErrc::kSystem, impl->options.name + ": monitor: " + zmq_strerror(zmq_errno()));
  impl->monitor = zmq_socket(context, ZMQ_PAIR);
  if (impl->monitor == nullptr || zmq_connect(impl->monitor, inproc.c_str()) != 0) {
    if (impl->monitor) zmq_close(impl->monitor);
    (void)zmq_socket_monitor(socket, nullptr, 0);
    return make_error(ListenErrc::kSystem, impl->options.name + ": monitor socket: " + zmq_strerror(zmq_errno()));
  }
  const int linger = 0;
  zmq_setsockopt(impl->monitor, ZMQ_LINGER, &linger, sizeof linger);
  auto* raw = impl.get();
  raw->thread = std::thread([raw] { raw->loop(); });
  return std::unique_ptr<ZmqListenerGuard>(new ZmqListenerGuard(std::move(impl)));
}

ZmqListenerGuard::ZmqListenerGuard(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ZmqListenerGuard::~ZmqListenerGuard() {
  impl_->stopping.store(true, std::memory_order_release);
  if (impl_->thread.joinable()) impl_->thread.join();
  zmq_close(impl_->monitor);
}

GuardStats ZmqListenerGuard::stats() const {
  MutexLock g(impl_->mu);
  return impl_->stats;
}

}  // namespace kvtd::listeners
