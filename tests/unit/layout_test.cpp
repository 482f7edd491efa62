#include "kvtd/kernels/layout.h"

#include <gtest/gtest.h>

#include <cstring>

#include <random>
#include <vector>

namespace kvtd::kernels {
namespace {

class LayoutBytes : public ::testing::TestWithParam<int> {};

// Staged object i, byte j of tensor t of layer l must equal byte j of block ids[i] of (l, t):
// checked by index arithmetic, independently of the implementation's loops.
TEST_P(LayoutBytes, GatherAndScatterMatchTheBlockFirstFormula) {
  const int elem = GetParam();
  const std::uint32_t layers = 4;
  const std::int64_t blocks = 20;
  // key, value: 2 heads x 4 tokens x 8 dims x elem; scales: 2 x 4 x 2 bytes
  const std::vector<std::uint64_t> per_tensor{64ull * static_cast<std::uint64_t>(elem),
                                              64ull * static_cast<std::uint64_t>(elem), 16, 16};
  std::mt19937 rng(static_cast<unsigned>(elem) * 7);
  std::vector<std::vector<std::byte>> storage;
  std::vector<LayerTensor> tensors;
  for (std::uint32_t l = 0; l < layers; ++l)
    for (auto bb : per_tensor) {
      storage.emplace_back(static_cast<std::size_t>(bb * blocks));
      for (auto& b : storage.back()) b = static_cast<std::byte>(rng());
    }
  for (std::size_t t = 0; t < storage.size(); ++t) tensors.push_back({storage[t].data(), per_tensor[t % 4], per_tensor[t % 4]});
  const std::uint64_t object = staging_object_bytes(tensors);
  EXPECT_EQ(object, layers * (per_tensor[0] + per_tensor[1] + 32));

  const std::vector<std::int32_t> ids{5, 0, 19, 6, 7};
  std::vector<std::byte> staging(static_cast<std::size_t>(object * ids.size()));
  gather_to_staging_host(tensors, ids, staging.data());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::uint64_t offset = 0;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const std::uint64_t bb = tensors[t].block_bytes;
      for (std::uint64_t j = 0; j < bb; ++j)
        ASSERT_EQ(staging[i * object + offset + j], storage[t][static_cast<std::uint64_t>(ids[i]) * bb + j])
            << "object " << i << " tensor " << t << " byte " << j;
      offset += bb;
    }
  }
  // Scatter into other blocks; everything else must be untouched.
  auto before = storage;
  const std::vector<std::int32_t> back{1, 2, 3, 10, 11};
  scatter_from_staging_host(tensors, back, staging.data());
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const std::uint64_t bb = tensors[t].block_bytes;
    for (std::int64_t b = 0; b < blocks; ++b) {
      std::size_t k = 0;
      while (k < back.size() && back[k] != b) ++k;
      const std::uint64_t from = k < back.size() ? static_cast<std::uint64_t>(ids[k]) * bb : static_cast<std::uint64_t>(b) * bb;
      for (std::uint64_t j = 0; j < bb; ++j)
        ASSERT_EQ(storage[t][static_cast<std::uint64_t>(b) * bb + j], before[t][from + j]) << "tensor " << t << " block " << b;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ElementSizes, LayoutBytes, ::testing::Values(1, 2, 4));

// A page-first host pool already holds each block in the stored order: gathering from its
// strided tensors gives each block's bytes exactly as they lie in the pool.
TEST(Layout, GatherFromAPageFirstPoolIsTheBlockItself) {
  const std::vector<std::uint64_t> piece{32, 32, 8, 8, 32, 32, 8, 8};
  std::uint64_t object = 0;
  for (auto p : piece) object += p;
  const std::int64_t blocks = 10;
  std::vector<std::byte> pool(static_cast<std::size_t>(object * blocks));
  std::mt19937 rng(5);
  for (auto& b : pool) b = static_cast<std::byte>(rng());
  std::vector<LayerTensor> tensors;
  std::uint64_t off = 0;
  for (auto p : piece) {
    tensors.push_back({pool.data() + off, p, object});
    off += p;
  }
  ASSERT_EQ(staging_object_bytes(tensors), object);
  const std::vector<std::int32_t> ids{7, 2, 9};
  std::vector<std::byte> staging(static_cast<std::size_t>(object * ids.size()));
  gather_to_staging_host(tensors, ids, staging.data());
  for (std::size_t i = 0; i < ids.size(); ++i)
    ASSERT_EQ(std::memcmp(staging.data() + i * object, pool.data() + static_cast<std::uint64_t>(ids[i]) * object, object), 0);
  // And scattering an object back writes the whole block, nothing around it.
  const auto before = pool;
  std::vector<std::byte> one(staging.begin(), staging.begin() + static_cast<std::ptrdiff_t>(object));
  const std::vector<std::int32_t> to{4};
  scatter_from_staging_host(tensors, to, one.data());
  for (std::int64_t b = 0; b < blocks; ++b) {
    const auto* want = b == 4 ? one.data() : before.data() + static_cast<std::uint64_t>(b) * object;
    ASSERT_EQ(std::memcmp(pool.data() + static_cast<std::uint64_t>(b) * object, want, object), 0) << "block " << b;
  }
}

}  // namespace
}  // namespace kvtd::kernels
