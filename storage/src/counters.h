// Internal: the call counters both stores keep, as relaxed atomics (stats are advisory).
#pragma once

#include <atomic>
#include <cstdint>

#include "kvtd/storage/object_store.h"

namespace kvtd::storage::detail {

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
