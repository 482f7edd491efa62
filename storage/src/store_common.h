// Internal: what both stores share: argument checks for a batch, and the call counters
// (relaxed atomics: stats are advisory).
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <string>

#include "kvtd/storage/object_store.h"

namespace kvtd::storage::detail {

// Every key valid, and `buffers` (destinations or sources, named by `noun`) one per key.
inline Status<StorageErrc> check_batch(std::span<const std::string> keys, std::size_t buffers, const char* noun) {
  if (keys.size() != buffers)
    return make_error(StorageErrc::kInvalidArgument,
                      std::to_string(keys.size()) + " keys but " + std::to_string(buffers) + " " + noun);
  for (const auto& k : keys)
    if (!valid_key(k)) return make_error(StorageErrc::kInvalidArgument, "invalid key '" + k + "'");
  return {};
}
inline Status<StorageErrc> check_keys(std::span<const std::string> keys) { return check_batch(keys, keys.size(), ""); }

struct Counters {
  std::atomic<std::uint64_t> puts{0}, put_failures{0}, gets{0}, hits{0}, misses{0}, corrupt{0};

  void count_get(ObjectResult r) {
    gets.fetch_add(1, std::memory_order_relaxed);
    (r == ObjectResult::kOk ? hits : misses).fetch_add(1, std::memory_order_relaxed);
    if (r == ObjectResult::kCorrupt) corrupt.fetch_add(1, std::memory_order_relaxed);
  }
  void count_put(ObjectResult r) {
    puts.fetch_add(1, std::memory_order_relaxed);
    if (r != ObjectResult::kOk) put_failures.fetch_add(1, std::memory_order_relaxed);
  }
  // The counters; eviction and size figures are the caller's to fill in.
  StoreStats snapshot() const {
    StoreStats s;
    s.puts = puts.load(std::memory_order_relaxed);
    s.put_failures = put_failures.load(std::memory_order_relaxed);
    s.gets = gets.load(std::memory_order_relaxed);
    s.hits = hits.load(std::memory_order_relaxed);
    s.misses = misses.load(std::memory_order_relaxed);
    s.corrupt = corrupt.load(std::memory_order_relaxed);
    return s;
  }
};

}  // namespace kvtd::storage::detail
