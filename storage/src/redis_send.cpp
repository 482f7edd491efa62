// The Redis store's zero-copy SET: header and payload pieces gathered into one sendmsg.
#include <fmt/format.h>
#include <hiredis/sds.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <vector>

#include "redis_support.h"

namespace kvtd::storage::detail {

bool send_set(redisContext* c, const std::string& key, const ObjectHeader& h, const ConstPieces& payload,
              std::uint64_t payload_bytes, std::int64_t ttl_s, bool asking) {
  if (c->obuf && sdslen(c->obuf) > 0) {
    // Something is queued in hiredis: flush it first so commands stay in order.
    int done = 0;
    while (!done)
      if (redisBufferWrite(c, &done) != REDIS_OK) return false;
  }
  std::string prefix = asking ? "*1\r\n$6\r\nASKING\r\n" : "";
  prefix += fmt::format("{}{}\r\n{}\r\n${}\r\n", ttl_s > 0 ? "*5\r\n$3\r\nSET\r\n$" : "*3\r\n$3\r\nSET\r\n$",
                        key.size(), key, sizeof h + payload_bytes);
  // The value's CRLF, then with a TTL "EX <seconds>" (the object expires on the server).
  const std::string ttl = std::to_string(ttl_s);
  const std::string suffix = ttl_s > 0 ? fmt::format("\r\n$2\r\nEX\r\n${}\r\n{}\r\n", ttl.size(), ttl) : "\r\n";
  // One piece per part of the payload (a block's tensors, in place), at most a few hundred:
  // well under IOV_MAX (1024).
  std::vector<iovec> iov;
  iov.reserve(payload.size() + 3);
  iov.push_back({prefix.data(), prefix.size()});
  iov.push_back({const_cast<ObjectHeader*>(&h), sizeof h});
  for (auto piece : payload) iov.push_back({const_cast<std::byte*>(piece.data()), piece.size()});
  iov.push_back({const_cast<char*>(suffix.data()), suffix.size()});
  std::size_t first = 0;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = iov.size() - first;
    // MSG_NOSIGNAL: a server that died must fail this call, not kill the process with SIGPIPE.
    const ssize_t w = ::sendmsg(c->fd, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;  // includes the send timeout (EAGAIN)
    }
    auto left = static_cast<std::size_t>(w);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (first < iov.size()) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return true;
}

}  // namespace kvtd::storage::detail
