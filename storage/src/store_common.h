// Internal: what both stores share: argument checks for a batch, landing a verified payload in
// a read's pieces, and the call counters (relaxed atomics: stats are advisory).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <fmt/format.h>
#include <span>
#include <string>

#include "kvtd/storage/object_store.h"

namespace kvtd::storage::detail {

// Every key valid.
inline Status<StorageErrc> check_keys(std::span<const std::string> keys) {
  for (const auto& k : keys)
    if (!valid_key(k)) return make_error(StorageErrc::kInvalidArgument, "invalid key '" + k + "'");
  return {};
}

// Every key valid, and a read's destination given.
inline Status<StorageErrc> check_read(std::span<const std::string> keys, const ReadInto& into) {
  if (!into.pieces) return make_error(StorageErrc::kInvalidArgument, "a read needs ReadInto::pieces");
  return check_keys(keys);
}
inline Status<StorageErrc> check_write(std::span<const std::string> keys, const WriteFrom& from) {
  if (!from.pieces) return make_error(StorageErrc::kInvalidArgument, "a write needs WriteFrom::pieces");
  return check_keys(keys);
}

template <typename Piece>
std::uint64_t bytes_in(const std::vector<Piece>& pieces) {
  std::uint64_t n = 0;
  for (const auto& p : pieces) n += p.size();
  return n;
}

// Object i's pieces must hold exactly one object: "" if they do, else why not (the key's error).
template <typename Piece>
std::string pieces_mismatch(std::size_t i, const std::vector<Piece>& pieces, std::uint64_t object_bytes) {
  const std::uint64_t n = bytes_in(pieces);
  if (n == object_bytes) return {};
  return fmt::format("object {}'s pieces hold {} bytes, not {}", i, n, object_bytes);
}

// Copies verified `payload` into object i's pieces; a key whose pieces do not add up to the payload
// fails, naming the mismatch. The caller reports it verified.
inline KeyResult land(std::size_t i, const Pieces& pieces, std::span<const std::byte> payload) {
  if (auto bad = pieces_mismatch(i, pieces, payload.size()); !bad.empty()) return {ObjectResult::kFailed, bad};
  std::size_t at = 0;
  for (auto piece : pieces) {
    std::memcpy(piece.data(), payload.data() + at, piece.size());
    at += piece.size();
  }
  return {ObjectResult::kOk, {}};
}

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
