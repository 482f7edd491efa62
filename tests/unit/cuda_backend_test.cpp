// The CUDA device backend against the host executor's bytes, in every scatter mode. Without a
// GPU it runs in the stand-in build (-DKVTD_CUDA_SIM=ON: cudasim runs the backend's runtime
// calls and its kernels on the CPU); in a plain build it skips unless a GPU is usable, and then
// runs for real.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "kvtd/daemon/device_backend.h"
#include "kvtd/kernels/checksum.h"
#include "kvtd/kernels/layout.h"

#ifdef KVTD_CUDA_SIM
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_runtime_api.h"
#include "kvtd/cudasim/control.h"
#endif

namespace kvtd::daemon {
namespace {

using daemon::ScatterMode;

constexpr ScatterMode kModes[] = {ScatterMode::kKernelAllLayers, ScatterMode::kKernelPerLayer, ScatterMode::kBatch,
                                  ScatterMode::kMemcpy};

const char* mode_name(ScatterMode m) { return daemon::scatter_mode_name(m); }

std::unique_ptr<DeviceBackend> backend_or_skip(ScatterMode mode) {
  auto b = make_cuda_backend(0, mode);
  if (!b.ok()) return nullptr;
  return std::move(b).value();
}

// `n` pairs over `blocks` ids without a duplicate destination: a run of 8 (src 10.., dst 40..)
// and scattered pairs, the rest shuffled.
void make_pairs(std::mt19937& rng, std::int32_t blocks, std::size_t n, std::vector<std::int32_t>& s,
                std::vector<std::int32_t>& d) {
  std::vector<std::int32_t> src_pool, dst_pool;
  for (std::int32_t i = 0; i < blocks; ++i) {
    if (i < 10 || i >= 18) src_pool.push_back(i);
    if (i < 40 || i >= 48) dst_pool.push_back(i);
  }
  std::shuffle(src_pool.begin(), src_pool.end(), rng);
  std::shuffle(dst_pool.begin(), dst_pool.end(), rng);
  s.resize(8);
  d.resize(8);
  std::iota(s.begin(), s.end(), 10);
  std::iota(d.begin(), d.end(), 40);
  s.insert(s.end(), src_pool.begin(), src_pool.begin() + static_cast<std::ptrdiff_t>(n - 8));
  d.insert(d.end(), dst_pool.begin(), dst_pool.begin() + static_cast<std::ptrdiff_t>(n - 8));
}

// A "device" tensor of `bytes` filled with random bytes, and its host copy.
struct DeviceTensor {
  std::byte* dev = nullptr;
  std::vector<std::byte> shadow;
};

DeviceTensor make_device_tensor(DeviceBackend& b, std::size_t bytes, std::mt19937& rng) {
  DeviceTensor t;
  auto d = b.alloc_device(bytes);
  EXPECT_TRUE(d.ok());
  if (!d.ok()) return t;
  t.dev = *d;
  t.shadow.resize(bytes);
  for (auto& x : t.shadow) x = static_cast<std::byte>(rng());
  EXPECT_TRUE(b.write_device(t.dev, t.shadow.data(), bytes).ok());
  return t;
}

// Host memory of the backend (pinned on CUDA) filled with random bytes; null if it failed.
std::byte* make_host_tensor(DeviceBackend& b, std::size_t bytes, std::mt19937& rng) {
  auto h = b.alloc_host(bytes);
  EXPECT_TRUE(h.ok());
  if (!h.ok()) return nullptr;
  for (std::size_t i = 0; i < bytes; ++i) (*h)[i] = static_cast<std::byte>(rng());
  return *h;
}

class CudaBackendTest : public ::testing::TestWithParam<ScatterMode> {};

// Device -> host and host -> device, three layers, block sizes that take the 16-byte, 8-byte
// and byte paths of the kernels (3 and 24 are not 16-aligned), one copy and layer by layer.
// 20488 and 17003 bytes: with KVTD_KERNEL_PIECE_KIB set below them (ctest runs this test a second
// time with 4) several warps share each block, the last part 8-byte (20488) or byte (17003) aligned.
TEST_P(CudaBackendTest, EveryModeMatchesTheHostExecutorByteForByte) {
  auto b = backend_or_skip(GetParam());
  if (!b) GTEST_SKIP() << "no usable GPU (and not the stand-in build)";
#ifdef KVTD_CUDA_SIM
  cudasim::reset_faults();  // call counts start here
#endif
  std::mt19937 rng(5);
  const std::int32_t blocks = 64;
  for (std::uint64_t bb : {std::uint64_t{16}, std::uint64_t{24}, std::uint64_t{3}, std::uint64_t{4096},
                          std::uint64_t{20488}, std::uint64_t{17003}}) {
    SCOPED_TRACE(fmt::format("{}, block bytes {}", mode_name(GetParam()), bb));
    const std::size_t bytes = static_cast<std::size_t>(blocks) * bb;
    std::vector<DeviceTensor> dev;
    std::vector<std::byte*> host;
    for (int l = 0; l < 3; ++l) {
      dev.push_back(make_device_tensor(*b, bytes, rng));
      auto h = b->alloc_host(bytes);
      ASSERT_TRUE(h.ok());
      host.push_back(*h);
    }
    std::vector<std::int32_t> s, d;
    make_pairs(rng, blocks, 40, s, d);
    auto plan = kernels::plan_copy(s, d, blocks, blocks, std::vector<std::uint64_t>{bb});
    ASSERT_TRUE(plan.ok()) << plan.error().message;
    ASSERT_FALSE(plan->runs.empty());
    ASSERT_FALSE(plan->single_src.empty());

    // Device -> host in one call.
    std::vector<kernels::CopyTarget> out, expect_out;
    std::vector<std::vector<std::byte>> expect(3, std::vector<std::byte>(bytes, std::byte{0}));
    for (int l = 0; l < 3; ++l) {
      out.push_back(kernels::packed_target(dev[l].dev, host[l], bb));
      expect_out.push_back(kernels::packed_target(dev[l].shadow.data(), expect[l].data(), bb));
    }
    kernels::copy_all_host(*plan, expect_out);
    auto st = b->copy(Direction::kToHost, *plan, out);
    ASSERT_TRUE(st.ok()) << st.error().message;
    for (int l = 0; l < 3; ++l) ASSERT_EQ(0, std::memcmp(expect[l].data(), host[l], bytes)) << "layer " << l;

    // Host -> device layer by layer: the callbacks come in layer order, enqueued before done.
    auto back = kernels::plan_copy(d, s, blocks, blocks, std::vector<std::uint64_t>{bb});
    ASSERT_TRUE(back.ok());
    std::vector<kernels::CopyTarget> in, expect_in;
    std::vector<std::vector<std::byte>> dev_expect;
    for (int l = 0; l < 3; ++l) dev_expect.push_back(dev[l].shadow);
    for (int l = 0; l < 3; ++l) {
      in.push_back(kernels::packed_target(host[l], dev[l].dev, bb));
      expect_in.push_back(kernels::packed_target(host[l], dev_expect[l].data(), bb));
    }
    kernels::copy_all_host(*back, expect_in);
    std::vector<std::uint32_t> enqueued, done;
    st = b->copy_layerwise(
        Direction::kToDevice, *back, in, 1, [&](std::uint32_t l) { enqueued.push_back(l); },
        [&](std::uint32_t l) {
          EXPECT_GT(enqueued.size(), l);
          done.push_back(l);
        });
    ASSERT_TRUE(st.ok()) << st.error().message;
    EXPECT_EQ(done, (std::vector<std::uint32_t>{0, 1, 2}));
#ifdef KVTD_CUDA_SIM
    // The stand-in counts launches: the kernel modes ran kvtd's kernels, the others none.
    const bool kernel_mode = GetParam() == ScatterMode::kKernelAllLayers || GetParam() == ScatterMode::kKernelPerLayer;
    EXPECT_EQ(cudasim::calls("cudaLaunchKernel") > 0, kernel_mode);
    EXPECT_EQ(cudasim::calls("cudaMemcpyBatchAsync") > 0, GetParam() == ScatterMode::kBatch);
#endif
    for (int l = 0; l < 3; ++l) {
      std::vector<std::byte> got(bytes);
      ASSERT_TRUE(b->read_device(got.data(), dev[l].dev, bytes).ok());
      ASSERT_EQ(0, std::memcmp(got.data(), dev_expect[l].data(), bytes)) << "layer " << l;
    }
  }
}

// The storage layout transform (block-first staging) through the kernels, both ways.
TEST_P(CudaBackendTest, StagingGatherAndScatterMatchTheHostTransform) {
  auto b = backend_or_skip(GetParam());
  if (!b) GTEST_SKIP() << "no usable GPU (and not the stand-in build)";
  std::mt19937 rng(9);
  const std::int32_t blocks = 16;
  std::vector<DeviceTensor> dev;
  std::vector<kernels::LayerTensor> tensors, shadows;
  for (std::uint64_t bb : {std::uint64_t{32}, std::uint64_t{6}, std::uint64_t{48}, std::uint64_t{12296}}) {
    dev.push_back(make_device_tensor(*b, static_cast<std::size_t>(blocks) * bb, rng));
    tensors.push_back(kernels::LayerTensor{dev.back().dev, bb, bb});
  }
  for (auto& t : dev) shadows.push_back(kernels::LayerTensor{t.shadow.data(), tensors[shadows.size()].block_bytes,
                                                             tensors[shadows.size()].stride});
  const std::vector<std::int32_t> ids{3, 0, 15, 7};
  const std::size_t object = 32 + 6 + 48 + 12296;
  auto staging = b->alloc_host(ids.size() * object);
  ASSERT_TRUE(staging.ok());
  std::vector<std::byte> expect(ids.size() * object);
  kernels::gather_to_staging_host(shadows, ids, expect.data());
  auto st = b->gather_to_staging(tensors, ids, *staging);
  ASSERT_TRUE(st.ok()) << st.error().message;
  ASSERT_EQ(0, std::memcmp(expect.data(), *staging, expect.size()));
  // Scatter other bytes back into other blocks.
  for (std::size_t i = 0; i < expect.size(); ++i) (*staging)[i] = static_cast<std::byte>(rng());
  const std::vector<std::int32_t> to{1, 2, 4, 9};
  kernels::scatter_from_staging_host(shadows, to, *staging);
  st = b->scatter_from_staging(tensors, to, *staging);
  ASSERT_TRUE(st.ok()) << st.error().message;
  for (std::size_t t = 0; t < dev.size(); ++t) {
    std::vector<std::byte> got(dev[t].shadow.size());
    ASSERT_TRUE(b->read_device(got.data(), dev[t].dev, got.size()).ok());
    ASSERT_EQ(got, dev[t].shadow) << "tensor " << t;
  }
}

// The storage movers gather and scatter one object at a time (each on the I/O thread that writes
// or read it), and each object paid two uploads before its launch: its id and the tensors'
// offsets in an object. Now its id goes by value and the offsets ride the target's table, sent
// once, in a table of its own: the next objects of the same target upload nothing, a swap-out
// between them or not; the bytes are the host transform's.
TEST_P(CudaBackendTest, AnObjectsTransformUploadsNothingOnceItsTargetsTableIsThere) {
  auto b = backend_or_skip(GetParam());
  if (!b) GTEST_SKIP() << "no usable GPU (and not the stand-in build)";
  std::mt19937 rng(29);
  const std::int32_t blocks = 8;
  std::vector<DeviceTensor> dev;
  std::vector<kernels::LayerTensor> tensors, shadows;
  for (std::uint64_t bb : {std::uint64_t{20496}, std::uint64_t{40}, std::uint64_t{7}}) {
    dev.push_back(make_device_tensor(*b, static_cast<std::size_t>(blocks) * bb, rng));
    tensors.push_back(kernels::LayerTensor{dev.back().dev, bb, bb});
    shadows.push_back(kernels::LayerTensor{dev.back().shadow.data(), bb, bb});
  }
  const std::size_t object = 20496 + 40 + 7;
  auto staging = b->alloc_host(object);
  ASSERT_TRUE(staging.ok());
  std::vector<std::byte> expect(object);
  for (std::int32_t id : {5, 2, 7}) {
#ifdef KVTD_CUDA_SIM
    cudasim::reset_faults();  // call counts start here
#endif
    const std::vector<std::int32_t> one{id};
    auto st = b->gather_to_staging(tensors, one, *staging);
    ASSERT_TRUE(st.ok()) << st.error().message;
#ifdef KVTD_CUDA_SIM
    if (id != 5) {
      EXPECT_EQ(cudasim::calls("cudaMemcpyAsync"), 0u) << "object of block " << id << ": nothing to upload";
    }
#endif
    kernels::gather_to_staging_host(shadows, one, expect.data());
    ASSERT_EQ(0, std::memcmp(expect.data(), *staging, object)) << "block " << id;
  }
  // A swap-out between two objects (write-through backs each one up) keeps its own table: the
  // next object still uploads nothing.
  auto swap_host = b->alloc_host(static_cast<std::size_t>(blocks) * 20496);
  ASSERT_TRUE(swap_host.ok());
  const auto swap = kernels::packed_target(dev[0].dev, *swap_host, 20496);
  const std::vector<std::int32_t> from{6}, into{1};
  auto plan = kernels::plan_copy(from, into, blocks, blocks, std::vector<std::uint64_t>{20496});
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(b->copy(Direction::kToHost, *plan, std::span<const kernels::CopyTarget>(&swap, 1)).ok());
#ifdef KVTD_CUDA_SIM
  cudasim::reset_faults();
#endif
  const std::vector<std::int32_t> again{4};
  ASSERT_TRUE(b->gather_to_staging(tensors, again, *staging).ok());
#ifdef KVTD_CUDA_SIM
  EXPECT_EQ(cudasim::calls("cudaMemcpyAsync"), 0u) << "the object after a swap-out";
#endif
  kernels::gather_to_staging_host(shadows, again, expect.data());
  ASSERT_EQ(0, std::memcmp(expect.data(), *staging, object));
  // One object back into block 3, by value as well.
  for (std::size_t i = 0; i < object; ++i) (*staging)[i] = static_cast<std::byte>(rng());
  const std::vector<std::int32_t> to{3};
  kernels::scatter_from_staging_host(shadows, to, *staging);
  ASSERT_TRUE(b->scatter_from_staging(tensors, to, *staging).ok());
  for (std::size_t t = 0; t < dev.size(); ++t) {
    std::vector<std::byte> got(dev[t].shadow.size());
    ASSERT_TRUE(b->read_device(got.data(), dev[t].dev, got.size()).ok());
    ASSERT_EQ(got, dev[t].shadow) << "tensor " << t;
  }
}

// --verify-swaps: the device's checksums of blocks, both sides of a target, equal the host's.
TEST_P(CudaBackendTest, DeviceChecksumsEqualTheHostsOnEveryBlockSize) {
  auto b = backend_or_skip(GetParam());
  if (!b) GTEST_SKIP() << "no usable GPU (and not the stand-in build)";
  std::mt19937 rng(13);
  const std::int32_t blocks = 8;
  std::vector<DeviceTensor> dev;
  std::vector<kernels::CopyTarget> out, in;
  for (std::uint64_t bb : {std::uint64_t{4096}, std::uint64_t{24}, std::uint64_t{101}}) {
    dev.push_back(make_device_tensor(*b, static_cast<std::size_t>(blocks) * bb, rng));
    out.push_back(kernels::CopyTarget{dev.back().dev, nullptr, bb, bb, bb});
    in.push_back(kernels::CopyTarget{nullptr, dev.back().dev, bb, bb, bb});
  }
  const std::vector<std::int32_t> ids{5, 0, 7};
  for (Direction dir : {Direction::kToHost, Direction::kToDevice}) {
    auto sums = b->device_checksums(dir, dir == Direction::kToHost ? out : in, ids);
    ASSERT_TRUE(sums.ok()) << sums.error().message;
    ASSERT_EQ(sums->size(), dev.size() * ids.size());
    for (std::size_t t = 0; t < dev.size(); ++t)
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const std::uint64_t bb = out[t].block_bytes;
        EXPECT_EQ((*sums)[t * ids.size() + i],
                  kernels::block_checksum(dev[t].shadow.data() + static_cast<std::uint64_t>(ids[i]) * bb, bb))
            << "tensor " << t << " block " << ids[i];
      }
  }
}

// --verify-swaps cost a second synchronisation per task (the H100: full mode -11%
// on 16-block tasks). copy_with_checksums enqueues the checksum kernel behind the copy on its
// stream and waits once; its sums are those of the bytes the copy wrote, in every mode.
TEST_P(CudaBackendTest, ACopyWithChecksumsWaitsOnceAndSumsTheBytesItCopied) {
  auto b = backend_or_skip(GetParam());
  if (!b) GTEST_SKIP() << "no usable GPU (and not the stand-in build)";
  std::mt19937 rng(17);
  const std::int32_t blocks = 16;
  const std::uint64_t bb = 4096;
  std::vector<DeviceTensor> dev;
  std::vector<kernels::CopyTarget> in;
  std::vector<std::vector<std::byte>> host_bytes;
  for (int l = 0; l < 2; ++l) {
    dev.push_back(make_device_tensor(*b, blocks * bb, rng));
    auto h = b->alloc_host(blocks * bb);
    ASSERT_TRUE(h.ok());
    for (std::size_t i = 0; i < blocks * bb; ++i) (*h)[i] = static_cast<std::byte>(rng());
    host_bytes.emplace_back(*h, *h + blocks * bb);
    in.push_back(kernels::packed_target(*h, dev.back().dev, bb));
  }
  const std::vector<std::int32_t> src{1, 2, 9}, dst{4, 11, 0};
  auto plan = kernels::plan_copy(src, dst, blocks, blocks, std::vector<std::uint64_t>{bb});
  ASSERT_TRUE(plan.ok()) << plan.error().message;
#ifdef KVTD_CUDA_SIM
  cudasim::reset_faults();  // call counts start here
#endif
  auto sums = b->copy_with_checksums(Direction::kToDevice, *plan, in, dst);
  ASSERT_TRUE(sums.ok()) << sums.error().message;
#ifdef KVTD_CUDA_SIM
  EXPECT_EQ(cudasim::calls("cudaStreamSynchronize"), 1u) << "the copy and its checksums: one wait";
#endif
  ASSERT_EQ(sums->size(), in.size() * dst.size());
  for (std::size_t t = 0; t < in.size(); ++t)
    for (std::size_t i = 0; i < dst.size(); ++i)
      EXPECT_EQ((*sums)[t * dst.size() + i],
                kernels::block_checksum(host_bytes[t].data() + static_cast<std::uint64_t>(src[i]) * bb, bb))
          << "tensor " << t << " device block " << dst[i];
  // No ids: a plain copy, no checksum kernel.
  auto none = b->copy_with_checksums(Direction::kToDevice, *plan, in, {});
  ASSERT_TRUE(none.ok()) << none.error().message;
  EXPECT_TRUE(none->empty());
}

// --verify-swaps in kernel mode cost a second pass over every byte: the H100's third run measured
// full mode 3.6% slower on 256 MiB tasks and 7.5% on 32 MiB ones with the checksum kernel enqueued
// behind the copy (a re-read, two more launches, another upload). The all-layers kernel now sums
// the bytes as it copies them: one launch for the copy and its sums. In every mode the sums are
// those of the bytes copied, for a run's blocks and scattered ones, blocks that take the 16-byte,
// 8-byte and byte paths (20496 bytes: in parts when ctest's second run sets
// KVTD_KERNEL_PIECE_KIB=4), both directions; a block the copy does not move is summed apart.
TEST_P(CudaBackendTest, KernelModeSumsTheBytesInTheCopysOwnPass) {
  auto b = backend_or_skip(GetParam());
  if (!b) GTEST_SKIP() << "no usable GPU (and not the stand-in build)";
  std::mt19937 rng(23);
  const std::int32_t blocks = 16;
  const std::vector<std::uint64_t> sizes{20496, 24, 101};
  std::vector<DeviceTensor> dev;
  std::vector<std::byte*> host;
  for (std::uint64_t bb : sizes) {
    dev.push_back(make_device_tensor(*b, blocks * bb, rng));
    host.push_back(make_host_tensor(*b, blocks * bb, rng));
    ASSERT_NE(host.back(), nullptr);
  }
  const std::vector<std::int32_t> host_ids{3, 4, 5, 9, 0, 12}, dev_ids{7, 8, 9, 1, 14, 2};
  auto plan = kernels::plan_copy(host_ids, dev_ids, blocks, blocks, sizes);
  ASSERT_TRUE(plan.ok()) << plan.error().message;
  ASSERT_EQ(plan->runs.size(), 1u);

  // Host -> device: the sums of the host blocks the device blocks were copied from.
  std::vector<kernels::CopyTarget> in;
  for (std::size_t t = 0; t < sizes.size(); ++t) in.push_back(kernels::packed_target(host[t], dev[t].dev, sizes[t]));
  const std::vector<std::int32_t> verify_in{8, 1, 2};  // host blocks 4, 9, 12
  const std::vector<std::int32_t> from{4, 9, 12};
#ifdef KVTD_CUDA_SIM
  cudasim::reset_faults();  // call counts start here
#endif
  auto sums = b->copy_with_checksums(Direction::kToDevice, *plan, in, verify_in);
  ASSERT_TRUE(sums.ok()) << sums.error().message;
#ifdef KVTD_CUDA_SIM
  EXPECT_EQ(cudasim::calls("cudaStreamSynchronize"), 1u);
  if (GetParam() == ScatterMode::kKernelAllLayers) {
    EXPECT_EQ(cudasim::calls("cudaLaunchKernel"), 1u) << "the copy sums in its own pass";
  }
#endif
  ASSERT_EQ(sums->size(), sizes.size() * verify_in.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    for (std::size_t k = 0; k < verify_in.size(); ++k)
      EXPECT_EQ((*sums)[t * verify_in.size() + k], kernels::block_checksum(host[t] + from[k] * sizes[t], sizes[t]))
          << "tensor " << t << ", device block " << verify_in[k];
    for (std::size_t i = 0; i < host_ids.size(); ++i) {  // and every pair landed
      std::vector<std::byte> got(sizes[t]);
      ASSERT_TRUE(b->read_device(got.data(), dev[t].dev + dev_ids[i] * sizes[t], sizes[t]).ok());
      ASSERT_EQ(0, std::memcmp(got.data(), host[t] + host_ids[i] * sizes[t], sizes[t])) << "tensor " << t;
      std::memcpy(dev[t].shadow.data() + dev_ids[i] * sizes[t], got.data(), sizes[t]);
    }
  }

  // Device -> host, the plan turned round; device block 5 is not in it: summed where it is.
  auto back = kernels::plan_copy(dev_ids, host_ids, blocks, blocks, sizes);
  ASSERT_TRUE(back.ok());
  std::vector<std::byte*> host2;
  std::vector<kernels::CopyTarget> out;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    auto h = b->alloc_host(blocks * sizes[t]);
    ASSERT_TRUE(h.ok());
    host2.push_back(*h);
    out.push_back(kernels::packed_target(dev[t].dev, *h, sizes[t]));
  }
  const std::vector<std::int32_t> verify_out{9, 14, 5};
  auto sums_out = b->copy_with_checksums(Direction::kToHost, *back, out, verify_out);
  ASSERT_TRUE(sums_out.ok()) << sums_out.error().message;
  ASSERT_EQ(sums_out->size(), sizes.size() * verify_out.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    for (std::size_t k = 0; k < verify_out.size(); ++k)
      EXPECT_EQ((*sums_out)[t * verify_out.size() + k],
                kernels::block_checksum(dev[t].shadow.data() + verify_out[k] * sizes[t], sizes[t]))
          << "tensor " << t << ", device block " << verify_out[k];
    for (std::size_t i = 0; i < host_ids.size(); ++i)
      ASSERT_EQ(0, std::memcmp(host2[t] + host_ids[i] * sizes[t], dev[t].shadow.data() + dev_ids[i] * sizes[t], sizes[t]));
  }
}

// --verify-swaps on a layer-by-layer load took the checksums of every layer after the last one:
// a second pass over the blocks, and every layer reported done before any was checked. Now each
// layer's checksums come with the layer, once its event fired: in kernel mode summed by the
// layer's own copy launch (one launch a layer, no checksum kernel), elsewhere by a checksum
// kernel right behind the layer's copy.
TEST_P(CudaBackendTest, ALayerByLayerCopyHandsOverEachLayersChecksumsOnceItIsDone) {
  auto b = backend_or_skip(GetParam());
  if (!b) GTEST_SKIP() << "no usable GPU (and not the stand-in build)";
  std::mt19937 rng(29);
  const std::int32_t blocks = 16;
  const std::size_t layers = 3, per_layer = 2;
  std::vector<std::uint64_t> sizes;
  for (std::size_t l = 0; l < layers; ++l) sizes.insert(sizes.end(), {20496, 101});
  std::vector<DeviceTensor> dev;
  std::vector<std::byte*> host;
  std::vector<kernels::CopyTarget> in;
  for (std::uint64_t bb : sizes) {
    dev.push_back(make_device_tensor(*b, blocks * bb, rng));
    host.push_back(make_host_tensor(*b, blocks * bb, rng));
    ASSERT_NE(host.back(), nullptr);
    in.push_back(kernels::packed_target(host.back(), dev.back().dev, bb));
  }
  const std::vector<std::int32_t> host_ids{3, 4, 5, 9, 0, 12}, dev_ids{7, 8, 9, 1, 14, 2};
  auto plan = kernels::plan_copy(host_ids, dev_ids, blocks, blocks, sizes);
  ASSERT_TRUE(plan.ok()) << plan.error().message;
  const std::vector<std::int32_t> verify{8, 1, 2};  // from host blocks 4, 9, 12
  const std::vector<std::int32_t> from{4, 9, 12};
  std::vector<std::uint32_t> enqueued, checked;
#ifdef KVTD_CUDA_SIM
  cudasim::reset_faults();  // call counts start here
#endif
  auto st = b->copy_layerwise_checked(
      Direction::kToDevice, *plan, in, per_layer, verify, [&](std::uint32_t l) { enqueued.push_back(l); },
      [&](std::uint32_t l, std::span<const std::uint64_t> sums) {
        checked.push_back(l);
        ASSERT_EQ(sums.size(), per_layer * verify.size());
        for (std::size_t t = 0; t < per_layer; ++t) {
          const std::size_t target = l * per_layer + t;
          for (std::size_t k = 0; k < verify.size(); ++k)
            EXPECT_EQ(sums[t * verify.size() + k], kernels::block_checksum(host[target] + from[k] * sizes[target], sizes[target]))
                << "layer " << l << ", tensor " << t << ", device block " << verify[k];
          for (std::size_t i = 0; i < host_ids.size(); ++i) {  // the layer is in place by now
            std::vector<std::byte> got(sizes[target]);
            ASSERT_TRUE(b->read_device(got.data(), dev[target].dev + dev_ids[i] * sizes[target], sizes[target]).ok());
            ASSERT_EQ(0, std::memcmp(got.data(), host[target] + host_ids[i] * sizes[target], sizes[target]));
          }
        }
      });
  ASSERT_TRUE(st.ok()) << st.error().message;
  EXPECT_EQ(enqueued, (std::vector<std::uint32_t>{0, 1, 2}));
  EXPECT_EQ(checked, (std::vector<std::uint32_t>{0, 1, 2}));
#ifdef KVTD_CUDA_SIM
  if (GetParam() == ScatterMode::kKernelAllLayers) {
    // The read_device calls above are copies, not launches; one summing launch a layer.
    EXPECT_EQ(cudasim::calls("cudaLaunchKernel"), layers) << "each layer's copy sums in its own pass";
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaBackendTest, ::testing::ValuesIn(kModes),
                         [](const auto& param_info) {
                           std::string n = mode_name(param_info.param);
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

#ifdef KVTD_CUDA_SIM
// Faults through the stand-in: what the daemon relies on when a copy fails.
struct FaultFixture {
  std::unique_ptr<DeviceBackend> b;
  std::vector<std::byte> shadow;
  std::byte* dev = nullptr;
  std::byte* host = nullptr;
  kernels::CopyPlan plan;  // 3 runs and 4 scattered blocks, device -> host
  static constexpr std::uint64_t kBlock = 256;
  static constexpr std::int32_t kBlocks = 32;

  explicit FaultFixture(ScatterMode mode) {
    b = backend_or_skip(mode);
    std::mt19937 rng(1);
    shadow.resize(kBlock * kBlocks);
    for (auto& x : shadow) x = static_cast<std::byte>(rng());
    dev = *b->alloc_device(shadow.size());
    host = *b->alloc_host(shadow.size());
    EXPECT_TRUE(b->write_device(dev, shadow.data(), shadow.size()).ok());
    const std::vector<std::int32_t> s{0, 1, 2, 10, 11, 20, 21, 5, 13, 27, 30};
    const std::vector<std::int32_t> d{0, 1, 2, 10, 11, 20, 21, 7, 15, 25, 31};
    plan = *kernels::plan_copy(s, d, kBlocks, kBlocks, std::vector<std::uint64_t>{kBlock});
  }
  Status<DeviceErrc> copy() {
    const auto t = kernels::packed_target(dev, host, kBlock);
    return b->copy(Direction::kToHost, plan, std::span<const kernels::CopyTarget>(&t, 1));
  }
  bool block_copied(std::int32_t from, std::int32_t to) const {
    return std::memcmp(host + to * kBlock, shadow.data() + from * kBlock, kBlock) == 0;
  }
};

TEST(CudaBackendFaults, KernelModesNeedHostPointersUsableByKernels) {
  setenv("KVTD_CUDASIM_NO_HOST_POINTERS", "1", 1);
  auto kernel = make_cuda_backend(0, ScatterMode::kKernelAllLayers);
  auto batch = make_cuda_backend(0, ScatterMode::kBatch);
  // Unset at the end: the device keeps saying so while the staging kernel runs.
  struct Unset {
    ~Unset() { unsetenv("KVTD_CUDASIM_NO_HOST_POINTERS"); }
  } unset;
  ASSERT_FALSE(kernel.ok());
  EXPECT_NE(kernel.error().message.find("cudaDevAttrCanUseHostPointerForRegisteredMem"), std::string::npos);
  ASSERT_TRUE(batch.ok()) << batch.error().message;
  // The staging transform still runs: its kernel gets the staging's mapped device pointer (the
  // stand-in faults a kernel handed the raw host address on such a device).
  std::mt19937 rng(2);
  auto t = make_device_tensor(**batch, 8 * 64, rng);
  auto staging = (*batch)->alloc_host(2 * 64);
  ASSERT_TRUE(staging.ok());
  const kernels::LayerTensor lt{t.dev, 64, 64};
  const std::vector<std::int32_t> ids{5, 2};
  ASSERT_TRUE((*batch)->gather_to_staging(std::span<const kernels::LayerTensor>(&lt, 1), ids, *staging).ok());
  EXPECT_EQ(0, std::memcmp(*staging, t.shadow.data() + 5 * 64, 64));
  EXPECT_EQ(0, std::memcmp(*staging + 64, t.shadow.data() + 2 * 64, 64));
}

TEST(CudaBackendFaults, AnUnchangedTargetTableIsNotUploadedAgain) {
  FaultFixture f(ScatterMode::kKernelAllLayers);
  cudasim::reset_faults();
  ASSERT_TRUE(f.copy().ok());
  const auto first = cudasim::calls("cudaMemcpyAsync");  // 3 runs + ids + table
  ASSERT_TRUE(f.copy().ok());
  EXPECT_EQ(cudasim::calls("cudaMemcpyAsync") - first, first - 1) << "the table went up again";
  // Another table (another destination) is uploaded, and used.
  std::byte* other = *f.b->alloc_host(f.shadow.size());
  const auto t = kernels::packed_target(f.dev, other, FaultFixture::kBlock);
  ASSERT_TRUE(f.b->copy(Direction::kToHost, f.plan, std::span<const kernels::CopyTarget>(&t, 1)).ok());
  EXPECT_EQ(0, std::memcmp(other + 15 * FaultFixture::kBlock, f.shadow.data() + 13 * FaultFixture::kBlock,
                           FaultFixture::kBlock));
  cudasim::reset_faults();
}

TEST(CudaBackendFaults, AFailedCopyFailsOnlyItsTaskAndTheNextOneSucceeds) {
  FaultFixture f(ScatterMode::kKernelAllLayers);
  cudasim::reset_faults();
  cudasim::inject_fault("cudaMemcpyAsync", 2, cudaErrorInvalidValue);  // the second run's copy
  auto st = f.copy();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, DeviceErrc::kCopyFailed);
  EXPECT_NE(st.error().message.find("cudaErrorInvalidValue"), std::string::npos) << st.error().message;
  EXPECT_FALSE(f.b->broken());
  st = f.copy();
  ASSERT_TRUE(st.ok()) << st.error().message << " (a stale error must not fail the next task)";
  EXPECT_TRUE(f.block_copied(13, 15) && f.block_copied(20, 20));
  cudasim::reset_faults();
}

TEST(CudaBackendFaults, NothingStillWritesOnceACopyReportsFailure) {
  FaultFixture f(ScatterMode::kMemcpy);
  cudasim::reset_faults();
  // Every stream operation takes 30 ms: when the third copy call fails, the first two are still
  // queued. The backend must wait for them before it reports the failure (the runner then
  // releases the task's blocks and the engine may reuse them).
  cudasim::set_op_delay_us(30'000);
  cudasim::inject_fault("cudaMemcpyAsync", 3, cudaErrorInvalidValue);
  auto st = f.copy();
  cudasim::set_op_delay_us(0);
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(f.block_copied(0, 0) && f.block_copied(10, 10)) << "copies enqueued before the failure were not drained";
  cudasim::reset_faults();
}

TEST(CudaBackendFaults, StickyErrorIsReportedAsALostContext) {
  // Sticky errors poison the process for good: in a child.
  const pid_t pid = fork();
  if (pid == 0) {
    FaultFixture f(ScatterMode::kKernelAllLayers);
    cudasim::inject_fault("cudaLaunchKernel", cudasim::calls("cudaLaunchKernel") + 1, cudaErrorIllegalAddress);
    auto st = f.copy();
    if (st.ok() || st.error().code != DeviceErrc::kContextLost) _exit(1);
    if (!f.b->broken()) _exit(2);
    auto again = f.copy();
    if (again.ok() || again.error().code != DeviceErrc::kContextLost) _exit(3);
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}
#endif

TEST(CudaBackend, UnavailableBackendSaysWhy) {
#ifdef KVTD_CUDA_SIM
  setenv("KVTD_CUDASIM_DEVICES", "0", 1);  // the stand-in without a device
  auto backend = make_cuda_backend(0);
  unsetenv("KVTD_CUDASIM_DEVICES");
  ASSERT_FALSE(backend.ok());
  EXPECT_NE(backend.error().message.find("cudaErrorNoDevice"), std::string::npos) << backend.error().message;
#else
  auto backend = make_cuda_backend(0);
#endif
  if (backend.ok()) GTEST_SKIP() << "a GPU (or the stand-in) is present";
  EXPECT_EQ(backend.error().code, DeviceErrc::kUnavailable);
  EXPECT_FALSE(backend.error().message.empty());
}

}  // namespace
}  // namespace kvtd::daemon
