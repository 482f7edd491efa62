// Internal: the Redis store's connection pieces (one server connection with reconnect backoff,
// owned replies, endpoints) and its garbage collection's per-server step.
#pragma once

#include <hiredis/hiredis.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "kvtd/storage/object_format.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::storage::detail {

using Clock = std::chrono::steady_clock;

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// One server connection with reconnect backoff.
struct Node {
  std::string host;
  int port = 0;
  redisContext* ctx = nullptr;
  Clock::time_point retry_at{};
  std::int64_t backoff_ms = 0;
  std::string failure;  // what armed the backoff, for the calls it makes wait

  ~Node() { drop(); }
  void drop() {
    if (ctx) redisFree(ctx);
    ctx = nullptr;
  }
};

inline bool parse_endpoint(const std::string& e, std::string* host, int* port) {
  const auto colon = e.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  *host = e.substr(0, colon);
  char* end = nullptr;
  const long p = std::strtol(e.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || p <= 0 || p > 65535) return false;
  *port = static_cast<int>(p);
  return true;
}

// One SCAN step of a garbage collection on one server: asks for the keys after `cursor`
// matching kvtd's namespace, removes (UNLINK) those `request` does not keep, counting into
// `report` (bytes by STRLEN). Returns the next cursor (0: this server is done), or nullopt when
// the server did not answer (the reason in *error).
std::optional<unsigned long long> gc_scan_step(redisContext* c, unsigned long long cursor, const GcRequest& request,
                                               const std::string& own_model, GcReport* report, std::string* error);

// Sends "[ASKING] SET <key> <h + payload> [EX ttl_s]" straight to c's socket (sendmsg, gathered),
// so the payload goes from the caller's pieces (payload_bytes in all) to the kernel without a
// copy (hiredis would format it into its output buffer); anything hiredis had queued is flushed
// first, so commands stay in order. False when the connection failed (the reply is read later
// with the pipeline's others).
bool send_set(redisContext* c, const std::string& key, const ObjectHeader& h, const ConstPieces& payload,
              std::uint64_t payload_bytes, std::int64_t ttl_s, bool asking);

}  // namespace kvtd::storage::detail
