// checksum_terms.h (kernels-internal) - the terms of checksum.h's block checksum for data at a
// known byte offset of its block, so that a kernel can add them up as the data passes through its
// registers: the copy kernels (whose sum is the bytes they copied, in the same pass) and the
// checksum kernel share these, and checksum.cpp's host loop is the reference both are tested
// against. Little-endian words, as on every machine kvtd runs on.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvtd::kernels {

// Word j of a block counts word * (2j + 1); `at` is a byte offset, a multiple of 8.
__device__ __forceinline__ unsigned long long word_weight(std::uint64_t at) { return 2 * (at / 8) + 1; }

// 16 bytes at offset `at` (a multiple of 16): two words.
__device__ __forceinline__ unsigned long long sum_terms(const int4& v, std::uint64_t at) {
  const unsigned long long lo =
      static_cast<unsigned>(v.x) | (static_cast<unsigned long long>(static_cast<unsigned>(v.y)) << 32);
  const unsigned long long hi =
      static_cast<unsigned>(v.z) | (static_cast<unsigned long long>(static_cast<unsigned>(v.w)) << 32);
  const unsigned long long w = word_weight(at);
  return lo * w + hi * (w + 2);
}

// One word at offset `at` (a multiple of 8).
__device__ __forceinline__ unsigned long long sum_terms(long long v, std::uint64_t at) {
  return static_cast<unsigned long long>(v) * word_weight(at);
}

// One byte at any offset: its place in its word times the word's weight (the word is the sum of
// its bytes' places, so the products add up to the word's term; a last word's missing bytes are
// the zero padding).
__device__ __forceinline__ unsigned long long sum_terms(unsigned char b, std::uint64_t at) {
  return (static_cast<unsigned long long>(b) << (8 * (at % 8))) * word_weight(at - at % 8);
}

}  // namespace kvtd::kernels
