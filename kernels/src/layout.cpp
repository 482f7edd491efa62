#include "kvtd/kernels/layout.h"

#include <cstring>

namespace kvtd::kernels {

std::uint64_t staging_object_bytes(std::span<const LayerTensor> tensors) {
  std::uint64_t sum = 0;
  for (const auto& t : tensors) sum += t.block_bytes;
  return sum;
}

void gather_to_staging_host(std::span<const LayerTensor> tensors, std::span<const std::int32_t> ids,
                            std::byte* staging) {
  for (const std::int32_t id : ids) {
    for (const auto& t : tensors) {
      std::memcpy(staging, t.base + static_cast<std::uint64_t>(id) * t.stride, t.block_bytes);
      staging += t.block_bytes;
    }
  }
}

void scatter_from_staging_host(std::span<const LayerTensor> tensors, std::span<const std::int32_t> ids,
                               const std::byte* staging) {
  for (const std::int32_t id : ids) {
    for (const auto& t : tensors) {
      std::memcpy(t.base + static_cast<std::uint64_t>(id) * t.stride, staging, t.block_bytes);
      staging += t.block_bytes;
    }
  }
}

}  // namespace kvtd::kernels
