// kvtd/listeners/zmq_listener_guard.h - caps the TCP connections a ZeroMQ socket has accepted.
// libzmq has no such cap: anyone who can reach a tcp:// listener (any local user on loopback)
// could hold connections until the daemon ran out of descriptors, and libzmq aborts the process
// when it then cannot make one it needs. The guard watches the socket's monitor (connections
// accepted and gone) and shuts down the connection its policy names once more than the cap are
// open: the oldest (a control socket, whose operators' requests are short, and the KV events
// PUB socket, where a reconnecting router must get past idle holders: a flood cannot hold the
// slots) or the newest (the connections already there keep their place).
//
// A connection is shut down only after checking that its descriptor is still a connected TCP
// socket on the guarded port (the number may have been closed by libzmq and reused meanwhile).
//
// Ownership: borrows the socket by its handle; the socket must outlive the guard. The guard owns
// its monitor socket and thread. Thread-safety: start() must be called by the thread that uses
// the socket, after its bind and before it uses it elsewhere (ZeroMQ sockets are not thread-safe);
// stats() from any thread. Not copyable.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kvtd/proto/expected.h"

namespace kvtd::listeners {

enum class ListenErrc { kInvalidArgument, kSystem };

enum class Evict { kOldest, kNewest };

struct GuardOptions {
  std::string name;             // for messages: "control socket tcp://127.0.0.1:5555"
  std::size_t max_connections;  // open at once; one more is shut down at once
  Evict evict = Evict::kOldest;
};

struct GuardStats {
  std::uint64_t accepted = 0;
  std::uint64_t shut_down = 0;  // connections closed by the cap
  std::size_t open = 0;
};

class ZmqListenerGuard {
 public:
  // Watches `zmq_socket` (a libzmq socket handle) of `zmq_context`, whose tcp:// endpoints are
  // bound already (the ports come from its last endpoint).
  static Result<std::unique_ptr<ZmqListenerGuard>, ListenErrc> start(void* zmq_context, void* zmq_socket,
                                                                     GuardOptions options);
  ~ZmqListenerGuard();
  ZmqListenerGuard(const ZmqListenerGuard&) = delete;
  ZmqListenerGuard& operator=(const ZmqListenerGuard&) = delete;

  GuardStats stats() const;

 private:
  struct Impl;
  explicit ZmqListenerGuard(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtd::listeners
