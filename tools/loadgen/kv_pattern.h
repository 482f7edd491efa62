// kv_pattern.h - the byte pattern the load generator and tests write into cache blocks.
//
// Every 8-byte word of a block encodes (rank, layer, tensor kind, pattern block, word index),
// so a misplaced, stale or torn copy is caught and can be named precisely. Header-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvtd::loadgen {

inline std::uint64_t pattern_word(std::uint32_t rank, std::uint32_t layer, std::uint32_t kind, std::uint32_t block,
                                  std::uint64_t word) {
  std::uint64_t x = (std::uint64_t{rank} << 56) ^ (std::uint64_t{layer} << 44) ^ (std::uint64_t{kind} << 40) ^
                    (std::uint64_t{block} << 12) ^ (word * 0x9E3779B97F4A7C15ULL);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 29;
  return x;
}

// Fills one block (block_bytes, any size) with the pattern of `pattern_block`.
inline void fill_block(std::byte* dst, std::uint64_t block_bytes, std::uint32_t rank, std::uint32_t layer,
                       std::uint32_t kind, std::uint32_t pattern_block) {
  const std::uint64_t words = block_bytes / 8;
  for (std::uint64_t w = 0; w < words; ++w) {
    const std::uint64_t v = pattern_word(rank, layer, kind, pattern_block, w);
    std::memcpy(dst + w * 8, &v, 8);
  }
  const std::uint64_t tail = block_bytes % 8;
  if (tail) {
    const std::uint64_t v = pattern_word(rank, layer, kind, pattern_block, words);
    std::memcpy(dst + words * 8, &v, tail);
  }
}

// Returns the byte offset of the first mismatch, or -1 if the block holds the pattern.
inline std::int64_t check_block(const std::byte* src, std::uint64_t block_bytes, std::uint32_t rank,
                                std::uint32_t layer, std::uint32_t kind, std::uint32_t pattern_block) {
  const std::uint64_t words = block_bytes / 8;
  for (std::uint64_t w = 0; w < words; ++w) {
    const std::uint64_t v = pattern_word(rank, layer, kind, pattern_block, w);
    if (std::memcmp(src + w * 8, &v, 8) != 0) return static_cast<std::int64_t>(w * 8);
  }
  const std::uint64_t tail = block_bytes % 8;
  if (tail) {
    const std::uint64_t v = pattern_word(rank, layer, kind, pattern_block, words);
    if (std::memcmp(src + words * 8, &v, tail) != 0) return static_cast<std::int64_t>(words * 8);
  }
  return -1;
}

}  // namespace kvtd::loadgen
