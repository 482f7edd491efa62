// Field order and presence follow vllm/distributed/kv_events.py at vllm-project/vllm commit
// 0181ea3173e5 (kMap): EventBatch(ts, events, data_parallel_rank=None) and events without
// array_like, so each is a map whose first key is msgspec's tag field "type"; BlockStored's
// fields without a default (block_hashes, parent_block_hash, token_ids, block_size, lora_id,
// medium, lora_name) are always written, those with one (extra_keys, group_idx,
// kv_cache_spec_*) are left out as omit_defaults leaves out their None, but for locality
// (LOCAL / REMOTE, vLLM main 017e9f44's kv_events.py:76, 101), written when the daemon names it. kArray is the earlier
// layout (array_like=True, e.g. commit b4e69e0af33f and the releases that added medium and
// lora_name): the same fields as arrays, the class name first; msgspec ignores trailing array
// elements a decoder's struct does not have, so older subscribers read it too.
#include "event_encoding.h"

#include <charconv>

#include "msgpack_writer.h"

namespace kvtd::events {
namespace {

void block_hash(MsgpackWriter& w, const std::string& key) {
  std::int64_t v = 0;
  const char* end = key.data() + key.size();
  const bool plain_decimal = !key.empty() && (key[0] != '0' || key.size() == 1) && key[0] != '+';
  if (plain_decimal) {
    const auto [ptr, ec] = std::from_chars(key.data(), end, v);
    if (ec == std::errc{} && ptr == end) {
      w.integer(v);
      return;
    }
  }
  w.bin(key);
}

void hashes(MsgpackWriter& w, const std::vector<std::string>& keys) {
  w.array(static_cast<std::uint32_t>(keys.size()));
  for (const auto& k : keys) block_hash(w, k);
}

// One event; `named(field)` writes a map key (kMap) or nothing (kArray).
void event(MsgpackWriter& w, const KvEvent& e, const BatchFields& f) {
  const bool map = f.format == KvEventsFormat::kMap;
  auto named = [&](const char* field) {
    if (map) w.str(field);
  };
  const char* type = e.kind == KvEventKind::kStored ? "BlockStored" : e.kind == KvEventKind::kRemoved ? "BlockRemoved" : "AllBlocksCleared";
  // locality (a default of None) is a map's only: in the array layout it would need every field
  // before it, and vLLM <= 0.10 has none of them.
  const bool locality = map && !f.locality.empty() && e.kind != KvEventKind::kCleared;
  const std::uint32_t fields =
      (e.kind == KvEventKind::kStored ? 7 : e.kind == KvEventKind::kRemoved ? 2 : 0) + (locality ? 1 : 0);
  if (map) {
    w.map(fields + 1);
    w.str("type");
  } else {
    w.array(fields + 1);
  }
  w.str(type);
  if (e.kind == KvEventKind::kCleared) return;
  named("block_hashes");
  hashes(w, e.keys);
  if (e.kind == KvEventKind::kStored) {
    named("parent_block_hash");
    w.nil();  // kvtd stores objects by key; the chain of prefixes is the engine's
    named("token_ids");
    w.array(0);  // nor does it know the tokens
    named("block_size");
    w.integer(f.block_size);
    named("lora_id");
    w.nil();
  }
  named("medium");
  w.str(f.medium);
  if (e.kind == KvEventKind::kStored) {
    named("lora_name");
    w.nil();
  }
  if (locality) {
    named("locality");
    w.str(f.locality);
  }
}

}  // namespace

std::string encode_batch(const std::vector<KvEvent>& events, const BatchFields& f) {
  MsgpackWriter w;
  const bool map = f.format == KvEventsFormat::kMap;
  const std::uint32_t n = f.data_parallel_rank ? 3 : 2;  // omit_defaults: no rank, no field
  if (map) {
    w.map(n);
    w.str("ts");
  } else {
    w.array(n);
  }
  w.float64(f.ts);
  if (map) w.str("events");
  w.array(static_cast<std::uint32_t>(events.size()));
  for (const auto& e : events) event(w, e, f);
  if (f.data_parallel_rank) {
    if (map) w.str("data_parallel_rank");
    w.integer(*f.data_parallel_rank);
  }
  return w.take();
}

}  // namespace kvtd::events
