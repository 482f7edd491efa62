// One batch of KV events as vLLM encodes it (vllm/distributed/kv_events.py: EventBatch,
// BlockStored, BlockRemoved, AllBlocksCleared; msgspec structs with omit_defaults=True and
// tag=True, so the class name is the tag).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvtd/events/kv_events.h"

namespace kvtd::events {

enum class KvEventKind : std::uint8_t { kStored, kRemoved, kCleared };

struct KvEvent {
  KvEventKind kind = KvEventKind::kCleared;
  std::vector<std::string> keys;  // the engine's keys (empty for kCleared)
};

struct BatchFields {
  KvEventsFormat format = KvEventsFormat::kMap;
  double ts = 0;  // seconds since the epoch, like vLLM's time.time()
  std::optional<std::int64_t> data_parallel_rank;
  std::string medium;
  std::string locality;  // "" leaves it out (None, omitted by omit_defaults); kMap only
  std::uint32_t block_size = 0;
};

// The msgpack payload of one batch (the third ZeroMQ frame).
std::string encode_batch(const std::vector<KvEvent>& events, const BatchFields& fields);

}  // namespace kvtd::events
