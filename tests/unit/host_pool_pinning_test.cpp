// The host pool pinned in the background (stand-in CUDA, -DKVTD_CUDA_SIM=ON): open() pins the
// first blocks and returns, threads pin the rest lowest blocks first, a caller waits only for
// the blocks it names, a failed piece is named to whoever waits for it, and a pool destroyed
// while pinning stops its threads and unpins what they pinned. KVTD_CUDASIM_PIN_MBPS makes each
// cudaHostRegister take time in proportion to its bytes, as on a machine.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fcntl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include "cuda_runtime_api.h"
#include "kvtd/cudasim/control.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/host_pool.h"

namespace kvtd::daemon {
namespace {

// 2 layers x K/V of 32 KiB blocks, 512 host blocks: 32 MiB of blocks.
proto::CacheGeometry geometry() {
  proto::CacheGeometry g{};
  g.num_ranks = 1;
  g.num_layers = 2;
  g.dtype = static_cast<std::uint32_t>(proto::CacheDtype::kBFloat16);
  g.num_host_blocks = 512;
  const std::int64_t shape[4] = {16, 8, 16, 128};
  std::copy(shape, shape + 4, g.key_shape);
  std::copy(shape, shape + 4, g.value_shape);
  return g;
}

std::uint64_t generation(int n) { return 0x52000000u + static_cast<std::uint64_t>(getpid()) * 16 + n; }

class HostPoolPinning : public ::testing::Test {
 protected:
  void SetUp() override {
    auto b = make_cuda_backend(0, ScatterMode::kKernelAllLayers);
    ASSERT_TRUE(b.ok()) << b.error().message;
    backend_ = std::move(b).value();
    cudasim::reset_faults();
  }
  void TearDown() override {
    unsetenv("KVTD_CUDASIM_PIN_MBPS");
    cudasim::reset_faults();
  }

  // 1 MiB first (the first 8 blocks: 4 tensors x 32 KiB each), then slices of 16, 32, ... blocks.
  static HostPool::PinPlan plan(std::uint32_t threads) {
    HostPool::PinPlan p;
    p.first_bytes = std::uint64_t{1} << 20;
    p.threads = threads;
    return p;
  }

  // Whether every byte of block `b` of every tensor is in a registration (kernels can reach it).
  bool block_pinned(const HostPool& pool, const proto::CacheGeometry& g, std::uint32_t b) {
    for (std::uint32_t l = 0; l < g.num_layers; ++l)
      for (auto kind : {proto::TensorKind::kKey, proto::TensorKind::kValue}) {
        std::byte* first = pool.region(l, kind) + b * pool.stride(kind);
        for (std::byte* at : {first, first + g.block_bytes(kind) - 1}) {
          void* mapped = nullptr;
          if (cudaHostGetDevicePointer(&mapped, at, 0) != cudaSuccess) {
            (void)cudaGetLastError();
            return false;
          }
        }
      }
    return true;
  }

  std::unique_ptr<DeviceBackend> backend_;
};

const auto kNever = []() -> std::optional<std::string> { return std::nullopt; };

// Before: open() pinned the whole pool before it returned (a terabyte pool: minutes before the
// first swap) and nothing could wait for part of it.
TEST_F(HostPoolPinning, OpenPinsTheFirstBlocksAndThreadsPinTheRestLowestFirst) {
  const auto g = geometry();
  for (auto layout : {daemon::HostLayout::kLayerFirst, daemon::HostLayout::kPageFirst}) {
    SCOPED_TRACE(layout == daemon::HostLayout::kPageFirst ? "page_first" : "layer_first");
    setenv("KVTD_CUDASIM_PIN_MBPS", "64", 1);  // 32 MiB: half a second on one thread
    auto pool = HostPool::open(*backend_, g, generation(static_cast<int>(layout)), 0, layout, -1, plan(2));
    ASSERT_TRUE(pool.ok()) << pool.error().message;
    HostPool& p = **pool;
    const auto at_open = p.pin_progress();
    EXPECT_GE(p.pinned_blocks(), 8u);
    EXPECT_TRUE(block_pinned(p, g, 0));
    EXPECT_TRUE(block_pinned(p, g, 7));
    EXPECT_LT(at_open.bytes_pinned, at_open.bytes_total) << "the whole pool was pinned before open returned";
    ASSERT_TRUE(p.wait_pinned(g.num_host_blocks, kNever).ok());
    EXPECT_EQ(p.pinned_blocks(), g.num_host_blocks);
    for (std::uint32_t b : {8u, 100u, 255u, 256u, 511u}) EXPECT_TRUE(block_pinned(p, g, b)) << "block " << b;
    const auto done = p.pin_progress();
    EXPECT_EQ(done.bytes_pinned, done.bytes_total);
    EXPECT_EQ(done.waits, 1u);
    EXPECT_GT(done.wait_ns, 0u);
    EXPECT_TRUE(done.error.empty()) << done.error;
    p.remove();
  }
}

TEST_F(HostPoolPinning, APoolNoLargerThanTheFirstShareIsPinnedWholeByOpen) {
  auto g = geometry();
  g.num_host_blocks = 8;  // exactly 1 MiB
  auto pool = HostPool::open(*backend_, g, generation(2), 0, daemon::HostLayout::kLayerFirst, -1, plan(2));
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  EXPECT_EQ((*pool)->pinned_blocks(), 8u);
  EXPECT_EQ((*pool)->pin_progress().registrations, 1u) << "four regions, consecutive: one registration";
  EXPECT_EQ((*pool)->pin_progress().bytes_pinned, (*pool)->pin_progress().bytes_total);
  (*pool)->remove();
}

// A piece that cannot be pinned leaves the blocks below it usable and every wait for blocks at or
// above it fails naming the piece and the driver's answer, at once.
TEST_F(HostPoolPinning, AFailedPieceIsNamedToEveryWaitForItsBlocks) {
  const auto g = geometry();
  // layer_first: the first slice is 4 registrations (one per region); the 6th call is the second
  // slice's second region (blocks 8-23).
  cudasim::inject_fault("cudaHostRegister", 6, cudaErrorMemoryAllocation);
  auto pool = HostPool::open(*backend_, g, generation(3), 0, daemon::HostLayout::kLayerFirst, -1, plan(1));
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  HostPool& p = **pool;
  EXPECT_TRUE(p.wait_pinned(8, kNever).ok());
  auto st = p.wait_pinned(24, kNever);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("piece 6 of"), std::string::npos) << st.error().message;
  EXPECT_NE(st.error().message.find("from block 8"), std::string::npos) << st.error().message;
  EXPECT_NE(st.error().message.find("cudaErrorMemoryAllocation"), std::string::npos) << st.error().message;
  EXPECT_EQ(p.pinned_blocks(), 8u);
  EXPECT_FALSE(p.pin_progress().error.empty());
  p.remove();
}

TEST_F(HostPoolPinning, AWaitGivesUpWithTheCallersReason) {
  const auto g = geometry();
  setenv("KVTD_CUDASIM_PIN_MBPS", "8", 1);  // 32 MiB: 4 s on one thread
  auto pool = HostPool::open(*backend_, g, generation(4), 0, daemon::HostLayout::kLayerFirst, -1, plan(1));
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  int polls = 0;
  auto st = (*pool)->wait_pinned(g.num_host_blocks, [&]() -> std::optional<std::string> {
    if (++polls < 3) return std::nullopt;
    return std::string("the task's deadline passed");
  });
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("the task's deadline passed"), std::string::npos) << st.error().message;
  EXPECT_NE(st.error().message.find("still being pinned"), std::string::npos) << st.error().message;
  EXPECT_EQ((*pool)->pin_progress().waits, 1u);
  (*pool)->remove();
}

// Destroyed mid-pinning (a session that ended at once): the threads stop after their current
// registration and every registration made is undone.
TEST_F(HostPoolPinning, APoolDestroyedWhilePinningStopsItsThreadsAndUnpinsWhatTheyPinned) {
  const auto g = geometry();
  setenv("KVTD_CUDASIM_PIN_MBPS", "16", 1);  // 32 MiB: 2 s on one thread
  {
    auto pool = HostPool::open(*backend_, g, generation(5), 0, daemon::HostLayout::kPageFirst, -1, plan(3));
    ASSERT_TRUE(pool.ok()) << pool.error().message;
    EXPECT_LT((*pool)->pinned_blocks(), g.num_host_blocks);
    (*pool)->remove();
  }
  EXPECT_EQ(cudasim::calls("cudaHostRegister"), cudasim::calls("cudaHostUnregister"));
}

// Whether the page holding `p` is mapped in this process's page table (/proc/self/pagemap bit 63).
bool page_present(const std::byte* p) {
  const int fd = ::open("/proc/self/pagemap", O_RDONLY);
  if (fd < 0) return false;
  std::uint64_t entry = 0;
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const off_t at = static_cast<off_t>(reinterpret_cast<std::uintptr_t>(p) / page * sizeof entry);
  const bool ok = pread(fd, &entry, sizeof entry, at) == static_cast<ssize_t>(sizeof entry);
  ::close(fd);
  return ok && (entry >> 63) != 0;
}

// Host memory that records how its pins were made: how many ran at once, and whether the pages
// of each piece were already faulted in when it was asked (its first, middle and last page).
class RecordingPins : public HostMemory {
 public:
  Result<std::byte*, DeviceErrc> alloc_host(std::size_t bytes) override {
    return static_cast<std::byte*>(std::calloc(1, bytes));
  }
  void free_host(std::byte* ptr) override { std::free(ptr); }
  Status<DeviceErrc> pin_host(std::byte* addr, std::size_t bytes) override {
    const int now = ++in_pin_;
    int seen = most_at_once_.load();
    while (now > seen && !most_at_once_.compare_exchange_weak(seen, now)) {
    }
    for (const std::byte* p : {addr, addr + bytes / 2, addr + bytes - 1})
      if (!page_present(p)) ++pins_of_absent_pages_;
    ++pins_;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // a registration takes time
    --in_pin_;
    return {};
  }
  void unpin_host(std::byte*) override {}

  std::atomic<int> in_pin_{0}, most_at_once_{0}, pins_{0}, pins_of_absent_pages_{0};
};

// Before: each pinning thread called cudaHostRegister on pages never touched in this process, so
// the driver faulted them in under its own lock; on an H100 machine four threads pinned a 32 GiB
// pool at 2.3 GB/s (one: 3.3) and the first swap waited 20 s, until they were all done. Now every
// piece's pages are faulted in beforehand, outside the driver, and registrations run one at a time.
TEST_F(HostPoolPinning, PagesAreFaultedInBeforeTheirRegistrationAndRegistrationsRunOneAtATime) {
  const auto g = geometry();
  RecordingPins pins;
  auto pool = HostPool::open(pins, g, generation(6), 0, daemon::HostLayout::kLayerFirst, -1, plan(4));
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  ASSERT_TRUE((*pool)->wait_pinned(g.num_host_blocks, kNever).ok());
  EXPECT_GT(pins.pins_.load(), 8) << "the pool was not pinned in pieces";
  EXPECT_EQ(pins.pins_of_absent_pages_.load(), 0) << "pages were left for the driver to fault in";
  EXPECT_EQ(pins.most_at_once_.load(), 1) << "registrations ran at once";
  (*pool)->remove();
}

}  // namespace
}  // namespace kvtd::daemon
