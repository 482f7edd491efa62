// http_client.h (tests) - raw HTTP/1.1 over loopback TCP, for tests of the daemon's metrics and
// health endpoints: the requests are written by hand so a test can also send broken ones.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace kvtd::test {

// An open connection to 127.0.0.1:port that sent `request` and keeps the socket (-1 on failure).
inline int http_open(std::uint16_t port, const std::string& request) {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(s);
    return -1;
  }
  (void)!write(s, request.data(), request.size());
  return s;
}

// Sends `request` raw and returns everything the server answers until it closes (`timeout_s` at
// most: a kubelet probe gives up after 1 s).
inline std::string http_exchange(std::uint16_t port, const std::string& request, int timeout_s = 5) {
  const int s = http_open(port, request);
  if (s < 0) return "";
  timeval tv{timeout_s, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string out;
  char buf[8192];
  for (ssize_t n; (n = read(s, buf, sizeof buf)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  ::close(s);
  return out;
}

inline std::string http_get(std::uint16_t port, const std::string& path) {
  return http_exchange(port, "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
}

// The body of a raw answer ("" when there is none).
inline std::string http_body(const std::string& reply) {
  const auto at = reply.find("\r\n\r\n");
  return at == std::string::npos ? "" : reply.substr(at + 4);
}

}  // namespace kvtd::test
