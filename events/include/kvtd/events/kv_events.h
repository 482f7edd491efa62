// kvtd/events/kv_events.h - KV events for KV-aware routers: which objects the storage tier
// holds, published on a ZeroMQ PUB socket in vLLM's KV-event wire format (vllm/distributed/
// kv_events.py), so a router that consumes vLLM's events consumes kvtd's unchanged.
//
// Wire: each batch is three frames, as vLLM's ZmqEventPublisher sends them: the topic, an
// 8-byte big-endian sequence number (0, 1, 2, ... per publisher), and the msgpack payload
// [ts, events, data_parallel_rank] (kArray) or {ts, events, data_parallel_rank} (kMap).
//
// Never blocks a caller: events go to a queue bounded in events and in bytes that one thread
// encodes and sends; a full queue drops the newest events (counted), a slow or absent subscriber
// loses what ZeroMQ's high-water mark drops (PUB semantics). Memory is bounded in bytes: a batch
// holds at most kMaxBatchBytes of keys, a subscriber's ZeroMQ queue send_high_water_mark batches.
// A removal that cannot be queued would leave a router believing in an object that is gone: an
// AllBlocksCleared follows the events queued before it, so the router forgets what it cannot
// trust (stores dropped that way only under-report). A router must treat the events as hints,
// as vLLM's own are.
//
// Thread-safety: stored/removed/cleared/stats may be called from any thread.
// Ownership: open() returns the only owner; the destructor sends what is queued (up to 1 s),
// then closes the socket. Not copyable or movable.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvtd/proto/expected.h"

namespace kvtd::events {

enum class EventsErrc {
  kInvalidArgument,  // a bad option; the message names it
  kSocket,           // ZeroMQ refused the endpoint (bind or connect)
};

// Payload layout. kMap: vLLM's current structs (no array_like: a map per struct, the event's
// class name under "type"); kArray: vLLM <= 0.10 (array_like=True: arrays, the class name first).
enum class KvEventsFormat { kMap, kArray };

struct KvEventsOptions {
  // tcp://*:5557 (bound), tcp://host:5557 (connected), ipc://path (bound): vLLM's rule, bind when
  // the endpoint has '*' or '::' or is ipc:// or inproc://, else connect.
  std::string endpoint;
  KvEventsFormat format = KvEventsFormat::kMap;
  std::string topic;                       // first frame; "" like vLLM's default
  std::string medium;                      // BlockStored/BlockRemoved "medium", e.g. "STORAGE"
  std::string locality;                    // their "locality" (LOCAL / REMOTE); "" leaves it out
  std::uint32_t block_size = 0;            // tokens per block, BlockStored's block_size
  std::optional<std::int64_t> data_parallel_rank;  // omitted from the batch when unset
  std::size_t max_queued_events = 100'000;
  std::size_t max_queued_bytes = 32u << 20;  // keys' bytes in the queue
  int send_high_water_mark = 32;           // ZMQ_SNDHWM, in batches (each at most kMaxBatchBytes)
  // A bound tcp:// endpoint takes at most this many connections (anyone who can reach the port
  // can connect): one more shuts the oldest down, so a router that reconnects always gets in and
  // idle holders cannot keep it out; one that has not finished ZeroMQ's handshake in 2 s is
  // dropped whatever the count.
  std::size_t max_subscribers = 16;
};

// A batch's keys take at most this many bytes (and it holds at most 1,024 events).
inline constexpr std::size_t kMaxBatchBytes = 256 * 1024;

struct KvEventsStats {
  std::uint64_t batches_sent = 0, events_sent = 0;
  std::uint64_t events_dropped = 0;  // the queue was full
  std::uint64_t clears_for_lost_removals = 0;  // AllBlocksCleared queued because removals were dropped
};

class KvEventPublisher {
 public:
  [[nodiscard]] static Result<std::unique_ptr<KvEventPublisher>, EventsErrc> open(const KvEventsOptions& options);
  ~KvEventPublisher();
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // The engine's keys of objects now stored / no longer stored. A key that is a decimal
  // integer in int64 range goes out as that integer (vLLM's int block hashes), any other as its
  // UTF-8 bytes (vLLM's ExternalBlockHash is bytes | int).
  void stored(std::vector<std::string> keys);
  void removed(std::vector<std::string> keys);
  // Every object of this medium is gone or unreachable (AllBlocksCleared).
  void cleared();

  KvEventsStats stats() const;
  // The endpoint the socket is bound or connected to (a bound tcp port 0 resolved).
  const std::string& endpoint() const;

 private:
  struct Impl;
  explicit KvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "map" | "array" -> the format; nullopt for anything else.
std::optional<KvEventsFormat> parse_kv_events_format(const std::string& name);

}  // namespace kvtd::events
