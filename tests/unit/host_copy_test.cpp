#include "kvtd/kernels/host_copy.h"
#include "kvtd/kernels/checksum.h"
#include "kvtd/kernels/cuda_copy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

namespace kvtd::kernels {
namespace {

struct Tensor {
  std::vector<std::byte> bytes;
  std::uint64_t block_bytes;
};

Tensor make(std::int64_t blocks, std::uint64_t block_bytes, std::uint32_t seed) {
  Tensor t{std::vector<std::byte>(static_cast<std::size_t>(blocks) * block_bytes), block_bytes};
  std::mt19937 rng(seed);
  for (auto& b : t.bytes) b = static_cast<std::byte>(rng());
  return t;
}

// Naive per-block reference: what the plan must produce.
void reference_copy(const std::vector<std::int32_t>& src, const std::vector<std::int32_t>& dst, const Tensor& from,
                    Tensor& to) {
  for (std::size_t i = 0; i < src.size(); ++i)
    std::copy_n(from.bytes.begin() + static_cast<std::ptrdiff_t>(src[i] * from.block_bytes), from.block_bytes,
                to.bytes.begin() + static_cast<std::ptrdiff_t>(dst[i] * to.block_bytes));
}

class HostCopyBytes : public ::testing::TestWithParam<int> {};

TEST_P(HostCopyBytes, MatchesNaiveReferenceForEveryElementSizeWithScales) {
  const int elem = GetParam();  // 1, 2 or 4 byte elements
  std::mt19937 rng(static_cast<unsigned>(elem));
  const std::int64_t dev_blocks = 40, host_blocks = 30;
  const std::uint32_t layers = 3;
  // Per layer: key, value (heads 2 x tokens 4 x dim 8 x elem) and two scale tensors (2 x 4 x 2 bytes).
  const std::vector<std::uint64_t> bytes{64ull * static_cast<std::uint64_t>(elem), 64ull * static_cast<std::uint64_t>(elem), 16, 16};
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<std::int32_t> src(static_cast<std::size_t>(dev_blocks)), dst(static_cast<std::size_t>(host_blocks));
    std::iota(src.begin(), src.end(), 0);
    std::iota(dst.begin(), dst.end(), 0);
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
    const std::size_t n = rng() % 25;
    src.resize(n);
    dst.resize(n);
    // Every other trial starts with a run: consecutive sources AND destinations (a run needs
    // both; the earlier version made only the sources consecutive and so rarely had one).
    const bool forced = trial % 2 == 0 && n > 3;
    if (forced) {
      const std::size_t k = n / 2;
      const auto a = static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(dev_blocks - static_cast<std::int64_t>(k)));
      const auto b = static_cast<std::int32_t>(rng() % static_cast<std::uint32_t>(host_blocks - static_cast<std::int64_t>(k)));
      std::vector<std::int32_t> rest;  // destinations outside the run, still unique
      for (std::int32_t d = 0; d < host_blocks; ++d)
        if (d < b || d >= b + static_cast<std::int32_t>(k)) rest.push_back(d);
      std::shuffle(rest.begin(), rest.end(), rng);
      for (std::size_t i = 0; i < n; ++i) {
        if (i < k) {
          src[i] = a + static_cast<std::int32_t>(i);
          dst[i] = b + static_cast<std::int32_t>(i);
        } else {
          dst[i] = rest[i - k];
        }
      }
    }
    // keep destinations unique, sources may repeat
    auto plan = plan_copy(src, dst, dev_blocks, host_blocks, bytes);
    ASSERT_TRUE(plan.ok()) << plan.error().message;
    if (forced) {
      ASSERT_FALSE(plan->runs.empty()) << "trial " << trial << " was meant to exercise a run";
      EXPECT_GE(plan->runs.front().count, 2);
    }
    std::vector<Tensor> dev, host, expect;
    std::vector<CopyTarget> targets;
    for (std::uint32_t l = 0; l < layers; ++l)
      for (std::size_t k = 0; k < bytes.size(); ++k) {
        dev.push_back(make(dev_blocks, bytes[k], l * 10 + static_cast<std::uint32_t>(k)));
        host.push_back(make(host_blocks, bytes[k], 1000 + l * 10 + static_cast<std::uint32_t>(k)));
      }
    expect = host;
    for (std::size_t t = 0; t < dev.size(); ++t) {
      reference_copy(src, dst, dev[t], expect[t]);
      targets.push_back(kernels::packed_target(dev[t].bytes.data(), host[t].bytes.data(), dev[t].block_bytes));
    }
    copy_all_host(*plan, targets);
    for (std::size_t t = 0; t < dev.size(); ++t) ASSERT_EQ(host[t].bytes, expect[t].bytes) << "tensor " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(ElementSizes, HostCopyBytes, ::testing::Values(1, 2, 4));

TEST(HostCopy, LayerwiseReportsEachLayerAfterItsBytes) {
  const std::uint64_t bb = 32;
  std::vector<Tensor> dev, host;
  std::vector<CopyTarget> targets;
  for (int t = 0; t < 6; ++t) {  // 3 layers x 2 tensors
    dev.push_back(make(8, bb, static_cast<std::uint32_t>(t)));
    host.push_back(make(8, bb, static_cast<std::uint32_t>(100 + t)));
  }
  for (int t = 0; t < 6; ++t) targets.push_back(kernels::packed_target(dev[t].bytes.data(), host[t].bytes.data(), bb));
  std::vector<std::int32_t> src{1, 2, 5}, dst{0, 1, 7};
  auto plan = plan_copy(src, dst, 8, 8, std::vector<std::uint64_t>{bb});
  ASSERT_TRUE(plan.ok());
  std::vector<std::uint32_t> seen;
  copy_layerwise_host(*plan, targets, 2, [&](std::uint32_t layer) {
    // Both tensors of this layer must already hold the copied bytes.
    for (int t = 0; t < 2; ++t) {
      const auto& h = host[layer * 2 + static_cast<std::uint32_t>(t)].bytes;
      const auto& d = dev[layer * 2 + static_cast<std::uint32_t>(t)].bytes;
      EXPECT_TRUE(std::equal(d.begin() + 5 * bb, d.begin() + 6 * bb, h.begin() + 7 * bb));
    }
    seen.push_back(layer);
  });
  EXPECT_EQ(seen, (std::vector<std::uint32_t>{0, 1, 2}));
}

// A page-first host pool: block b holds every (layer, tensor) piece back to back, so each
// target strides by the whole block. Evicting into it and loading back out of it (runs and
// scattered blocks both) must give the device bytes, and touch nothing but the named pieces.
TEST(HostCopy, PageFirstHostSideStridesByTheWholeBlock) {
  const std::vector<std::uint64_t> piece{48, 48, 8, 8, 48, 48, 8, 8};  // 2 layers x K, V, Ks, Vs
  const std::uint64_t object = std::accumulate(piece.begin(), piece.end(), std::uint64_t{0});
  const std::int64_t dev_blocks = 16, host_blocks = 12;
  std::vector<Tensor> dev;
  for (std::size_t t = 0; t < piece.size(); ++t) dev.push_back(make(dev_blocks, piece[t], static_cast<std::uint32_t>(t)));
  Tensor pool = make(host_blocks, object, 99);
  const Tensor pool_before = pool;
  std::vector<CopyTarget> out, in;
  std::uint64_t offset = 0;
  for (std::size_t t = 0; t < piece.size(); ++t) {
    out.push_back({dev[t].bytes.data(), pool.bytes.data() + offset, piece[t], piece[t], object});
    in.push_back({pool.bytes.data() + offset, dev[t].bytes.data(), piece[t], object, piece[t]});
    offset += piece[t];
  }
  const std::vector<std::int32_t> src{3, 4, 5, 9, 0}, dst{6, 7, 8, 1, 11};  // a run of 3 and two singles
  auto plan = plan_copy(src, dst, dev_blocks, host_blocks, piece);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->runs.size(), 1u);
  copy_all_host(*plan, out);
  for (std::int64_t b = 0; b < host_blocks; ++b) {
    const auto at = std::find(dst.begin(), dst.end(), static_cast<std::int32_t>(b));
    std::uint64_t off = 0;
    for (std::size_t t = 0; t < piece.size(); ++t) {
      const auto* got = pool.bytes.data() + static_cast<std::uint64_t>(b) * object + off;
      const auto* want = at == dst.end() ? pool_before.bytes.data() + static_cast<std::uint64_t>(b) * object + off
                                         : dev[t].bytes.data() + static_cast<std::uint64_t>(src[at - dst.begin()]) * piece[t];
      ASSERT_EQ(std::memcmp(got, want, piece[t]), 0) << "host block " << b << " piece " << t;
      off += piece[t];
    }
  }
  // Back to other device blocks.
  const std::vector<std::int32_t> back{12, 13, 14, 2, 10};
  auto plan_in = plan_copy(dst, back, host_blocks, dev_blocks, piece);
  ASSERT_TRUE(plan_in.ok());
  copy_all_host(*plan_in, in);
  for (std::size_t t = 0; t < piece.size(); ++t)
    for (std::size_t i = 0; i < src.size(); ++i)
      ASSERT_EQ(std::memcmp(dev[t].bytes.data() + static_cast<std::uint64_t>(back[i]) * piece[t],
                            dev[t].bytes.data() + static_cast<std::uint64_t>(src[i]) * piece[t], piece[t]),
                0)
          << "tensor " << t << " block " << back[i];
}

// --verify-swaps' checksum: every single flipped bit of a block changes it (sizes that end in a
// partial word included), a word moved elsewhere changes it, and it is the documented sum.
TEST(BlockChecksum, EveryFlippedBitAndEveryMovedWordChangesIt) {
  std::mt19937 rng(11);
  for (std::size_t bytes : {std::size_t{8}, std::size_t{24}, std::size_t{101}, std::size_t{4096}}) {
    std::vector<std::byte> b(bytes);
    for (auto& x : b) x = static_cast<std::byte>(rng());
    const std::uint64_t sum = block_checksum(b.data(), bytes);
    for (std::size_t bit = 0; bit < bytes * 8; bit += bytes > 200 ? 7 : 1) {
      b[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
      EXPECT_NE(block_checksum(b.data(), bytes), sum) << bytes << " bytes, bit " << bit;
      b[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    }
    if (bytes >= 16) {
      std::swap_ranges(b.begin(), b.begin() + 8, b.begin() + 8);
      EXPECT_NE(block_checksum(b.data(), bytes), sum) << "two words swapped";
    }
  }
  const std::uint64_t words[2] = {3, 5};  // 3 * 1 + 5 * 3
  EXPECT_EQ(block_checksum(reinterpret_cast<const std::byte*>(words), 16), 18u);
}

// The copy kernels' parts per block (cuda_copy.h: pure arithmetic, tested here where every build
// runs it). A launch that fills the GPU keeps whole blocks; a small one splits, parts of 4 KiB at
// the least, 64 at most.
TEST(KernelParts, ASmallLaunchSplitsItsBlocksAndALargeOneDoesNot) {
  const std::uint64_t fill = 132 * 16;  // an H100: 132 SMs, 16 warps each
  EXPECT_EQ(pieces_to_fill(32768, 128 * 64, fill), 1u);  // 128 blocks x 64 tensors
  EXPECT_EQ(pieces_to_fill(8192, 256 * 16, fill), 1u);   // the selftest's sweep: as measured
  EXPECT_EQ(pieces_to_fill(32768, fill, fill), 1u);
  EXPECT_EQ(pieces_to_fill(32768, 16 * 64, fill), 3u);  // 16 blocks: 1,024 warps -> 3,072
  EXPECT_EQ(pieces_to_fill(32768, 64, fill), 8u);       // one block: as many as 4 KiB parts allow
  EXPECT_EQ(pieces_to_fill(1 << 20, 1, fill), 64u);      // one 1 MiB block: at most 64
  EXPECT_EQ(pieces_to_fill(4096, 1, fill), 1u);         // nothing to cut below 2 x 4 KiB
  EXPECT_EQ(pieces_to_fill(8191, 1, fill), 1u);
  EXPECT_EQ(pieces_to_fill(8192, 1, fill), 2u);
  EXPECT_EQ(pieces_to_fill(65536, 0, fill), 1u);        // an empty launch
  EXPECT_EQ(pieces_for(65536, 0), 1u);                   // a fixed part: 0 = whole blocks
  EXPECT_EQ(pieces_for(65536, 4096), 16u);
}

}  // namespace
}  // namespace kvtd::kernels
