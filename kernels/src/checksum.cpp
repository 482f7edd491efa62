#include "kvtd/kernels/checksum.h"

#include <cstring>

namespace kvtd::kernels {

std::uint64_t block_checksum(const std::byte* p, std::uint64_t bytes) {
  std::uint64_t sum = 0;
  std::uint64_t j = 0;
  for (; (j + 1) * 8 <= bytes; ++j) {
    std::uint64_t word = 0;
    std::memcpy(&word, p + j * 8, 8);  // little-endian: every machine kvtd runs on
    sum += word * (2 * j + 1);
  }
  if (j * 8 < bytes) {
    std::uint64_t word = 0;
    std::memcpy(&word, p + j * 8, bytes - j * 8);
    sum += word * (2 * j + 1);
  }
  return sum;
}

}  // namespace kvtd::kernels
