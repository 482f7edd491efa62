// kvtd/proto/checked.h - 64-bit arithmetic that reports overflow instead of wrapping.
//
// Every size product in kvtd goes through these (rule 9): shapes and counts come from flags,
// config files and shared memory, and a wrapped product is a buffer overrun later.
#pragma once

#include <cstdint>

namespace kvtd::proto {

[[nodiscard]] constexpr bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}
[[nodiscard]] constexpr bool checked_add(std::uint64_t a, std::uint64_t b, std::uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}
// Rounds up to a multiple of `align` (> 0); false on overflow.
[[nodiscard]] constexpr bool checked_align_up(std::uint64_t v, std::uint64_t align, std::uint64_t* out) {
  std::uint64_t t = 0;
  if (!checked_add(v, align - 1, &t)) return false;
  *out = t / align * align;
  return true;
}

}  // namespace kvtd::proto
