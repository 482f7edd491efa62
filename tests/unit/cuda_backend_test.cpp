// The CUDA device backend against the host executor's bytes. Skips where no GPU is usable
// (every machine of this project); runs for real on a GPU machine.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "kvtd/daemon/device_backend.h"

namespace kvtd::daemon {
namespace {

TEST(CudaBackend, RunsAndScatteredBlocksMatchTheHostExecutor) {
  auto backend = make_cuda_backend(0);
  if (!backend.ok()) GTEST_SKIP() << "no usable GPU: " << backend.error().message;
  std::mt19937 rng(5);
  for (std::uint64_t bb : {std::uint64_t{16}, std::uint64_t{24}, std::uint64_t{131072}, std::uint64_t{3}}) {
    const std::int64_t blocks = 64;
    auto src = (*backend)->alloc_host(static_cast<std::size_t>(blocks * bb));
    auto dst = (*backend)->alloc_host(static_cast<std::size_t>(blocks * bb));
    ASSERT_TRUE(src.ok() && dst.ok());
    for (std::uint64_t i = 0; i < blocks * bb; ++i) (*src)[i] = static_cast<std::byte>(rng());
    std::vector<std::byte> expect(static_cast<std::size_t>(blocks * bb), std::byte{0});
    std::vector<std::int32_t> s(blocks), d(blocks);
    std::iota(s.begin(), s.end(), 0);
    std::iota(d.begin(), d.end(), 0);
    std::shuffle(d.begin(), d.end(), rng);
    std::iota(d.begin(), d.begin() + 8, 40);  // a run among scattered blocks
    std::iota(s.begin(), s.begin() + 8, 10);
    s.resize(40);
    d.resize(40);
    auto plan = kernels::plan_copy(s, d, blocks, blocks, std::vector<std::uint64_t>{bb});
    ASSERT_TRUE(plan.ok()) << plan.error().message;
    kernels::CopyTarget host_t = kernels::packed_target(*src, expect.data(), bb);
    kernels::copy_blocks_host(*plan, host_t);
    kernels::CopyTarget gpu_t = kernels::packed_target(*src, *dst, bb);
    auto st = (*backend)->copy(Direction::kToHost, *plan, std::span<const kernels::CopyTarget>(&gpu_t, 1));
    ASSERT_TRUE(st.ok()) << st.error().message;
    ASSERT_EQ(0, std::memcmp(expect.data(), *dst, expect.size())) << "block bytes " << bb;
  }
}

TEST(CudaBackend, UnavailableBackendSaysWhy) {
  auto backend = make_cuda_backend(0);
  if (backend.ok()) GTEST_SKIP() << "a GPU is present";
  EXPECT_EQ(backend.error().code, DeviceErrc::kUnavailable);
  EXPECT_FALSE(backend.error().message.empty());
}

}  // namespace
}  // namespace kvtd::daemon
