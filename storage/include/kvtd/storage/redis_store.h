// kvtd/storage/redis_store.h - the shared storage tier for many nodes: Redis, standalone or
// Redis Cluster, through hiredis.
//
// Each batch is pipelined: one round trip per server touched, not per key. In cluster mode the
// slot map comes from CLUSTER SLOTS (CRC16 hashing of the key), MOVED updates the map and
// retries, ASK retries once on the named node behind ASKING. The password is read from a file or
// an environment variable, never from the command line. A server that is down fails the call's
// keys (kFailed) or the call (kUnavailable) within `timeout_ms`; connections are re-made on
// later calls with exponential backoff. Nothing blocks past the call's deadline.
//
// Large SET payloads are sent straight from the caller's buffer (sendmsg, MSG_NOSIGNAL); hiredis
// itself writes small commands with write(2), so a process using this store should ignore
// SIGPIPE (kvtd does).
//
// Thread-safety: any thread. Reads (EXISTS, GET) and writes (SET, DEL) have a set of connections
// each, one per server, and calls of each kind are serialised on theirs: a load never waits
// behind a slow or paused write (found by StoreStallTest with CLIENT PAUSE ... WRITE).
#pragma once

#include "kvtd/storage/object_store.h"

namespace kvtd::storage {

struct RedisStoreOptions {
  StoreOptions store;
  std::vector<std::string> endpoints;  // "host:port"; in cluster mode any subset of the nodes
  bool cluster = false;
  // With cluster = false: ask the first reachable endpoint at open (CLUSTER INFO) and use
  // cluster mode if it is a Cluster node. If none answers at open, standalone is assumed.
  bool detect_cluster = false;
  std::string password_file;           // first line is the password
  std::string password_env;            // name of an environment variable holding it
  std::int64_t timeout_ms = 2000;      // connect and per-reply deadline
  std::int64_t max_backoff_ms = 1000;  // reconnect backoff cap
  std::int64_t ttl_s = 0;              // > 0: every object expires this many seconds after its write (SET EX)
};

Result<std::unique_ptr<ObjectStore>, StorageErrc> open_redis_store(const RedisStoreOptions& options);

// CRC16-XMODEM of the key modulo 16384, as Redis Cluster assigns slots (honours {hash tags}).
std::uint16_t redis_cluster_slot(const std::string& key);

}  // namespace kvtd::storage
