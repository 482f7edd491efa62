// Multi-process tests: this process is the engine; every rank daemon is a real `kvtd` process.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include "daemon_fixture.h"

namespace kvtd {
namespace {

TEST_F(DaemonTest, TwoRanksRoundTripRandomBlockSetsByteExact) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  std::mt19937 rng(3);
  for (int it = 0; it < 30; ++it) {
    std::vector<std::int32_t> dev(32), host(24), dev2(32);
    std::iota(dev.begin(), dev.end(), 0);
    std::iota(host.begin(), host.end(), 0);
    std::iota(dev2.begin(), dev2.end(), 0);
    std::shuffle(dev.begin(), dev.end(), rng);
    std::shuffle(host.begin(), host.end(), rng);
    std::shuffle(dev2.begin(), dev2.end(), rng);
    const std::size_t n = 1 + rng() % 20;
    dev.resize(n);
    host.resize(n);
    dev2.resize(n);
    if (it % 3 == 0) {  // consecutive runs on both sides
      std::iota(dev.begin(), dev.end(), 2);
      std::iota(host.begin(), host.end(), 1);
    }
    round_trip(dev, host, dev2);
    if (HasFatalFailure()) return;
  }
}

TEST_F(DaemonTest, Fp8WithScalesAndNoValueCacheRoundTrips) {
  g_ = test::small_geometry(2, proto::CacheDtype::kBlockWiseFp8, /*with_value=*/false);
  ASSERT_NO_FATAL_FAILURE(start_all());
  round_trip({5, 6, 7, 20}, {0, 1, 2, 9}, {9, 10, 11, 0});
}

// FastDeploy cache manager v1 makes fp8 scales in float32; the value-scale tensor is swapped too.
TEST_F(DaemonTest, Fp8WithFourByteScalesAndAValueCacheRoundTrips) {
  g_ = test::small_geometry(2, proto::CacheDtype::kBlockWiseFp8);
  g_.scale_bytes = 4;
  ASSERT_EQ(g_.block_bytes(proto::TensorKind::kValueScale), 2u * 4u * 4u);  // heads x tokens x 4 bytes
  ASSERT_NO_FATAL_FAILURE(start_all());
  round_trip({5, 6, 7, 20}, {0, 1, 2, 9}, {9, 10, 11, 0});
}

// Seed 000's num_extra_cache_layer: MTP layers after the model's, with their own (here fewer)
// device blocks, and a 3-D cache shape (head_dim 1, seed 004).
TEST_F(DaemonTest, ExtraMtpLayersWithTheirOwnBlockCountAnd3dShapeRoundTrip) {
  set_geometry(4, 32, 2, 4, 1, 24);
  g_.num_extra_layers = 2;
  g_.extra_device_blocks = 12;
  ASSERT_NO_FATAL_FAILURE(start_all());
  round_trip({5, 6, 7, 11}, {0, 1, 2, 9}, {9, 10, 11, 0});
  // Block 20 exists in the model's layers but not in the extra ones: refused, nothing written.
  auto r = run(TaskKind::kSwapToHost, {20}, {3});
  ASSERT_EQ(r.status, TaskStatus::kIdOutOfRange);
  EXPECT_NE(r.failures[0].message.find("[0, 12)"), std::string::npos) << r.failures[0].message;
}

// The affinity list of each thread of `pid` whose name starts with `prefix`.
std::map<std::string, std::string> thread_cpus(pid_t pid, const std::string& prefix) {
  std::map<std::string, std::string> out;
  const std::string dir = fmt::format("/proc/{}/task", pid);
  for (const auto& t : std::filesystem::directory_iterator(dir)) {
    std::string comm = test::read_file(t.path().string() + "/comm");
    while (!comm.empty() && comm.back() == '\n') comm.pop_back();
    if (comm.rfind(prefix, 0) != 0) continue;
    std::istringstream status(test::read_file(t.path().string() + "/status"));
    for (std::string line; std::getline(status, line);)
      if (line.rfind("Cpus_allowed_list:", 0) == 0) out[comm] = line.substr(line.find_first_not_of(" \t", 18));
  }
  return out;
}

// --numa-node: the swap lanes and storage workers are named and run on that node's CPUs; a node
// that does not exist is a warning, and the daemon serves unbound.
TEST_F(DaemonTest, CopyThreadsRunOnTheNumaNodeGivenAndAMissingNodeIsOnlyAWarning) {
  std::string node0 = test::read_file("/sys/devices/system/node/node0/cpulist");
  if (node0.empty()) GTEST_SKIP() << "no /sys/devices/system/node/node0 here";
  while (!node0.empty() && node0.back() == '\n') node0.pop_back();
  const std::string store = ::testing::TempDir() + "/" + suffix_ + "_numa_store";
  extra_args_ = {"--numa-node", "0", "--storage-backend", "file", "--storage-path", store, "--model-id", "m"};
  daemons_.push_back(start_daemon(0));
  extra_args_ = {"--numa-node", "7"};
  daemons_.push_back(start_daemon(1));
  ASSERT_NO_FATAL_FAILURE(start_engine());
  ASSERT_TRUE(engine_->wait_ready(20'000'000'000).ok());
  round_trip({1, 2}, {3, 4}, {5, 6});
  // Each thread names and binds itself when it first runs; an idle storage worker may not have
  // been scheduled yet on a busy machine (seen in CI), so wait for all three.
  std::map<std::string, std::string> bound;
  const bool all_named = test::eventually(
      [&] {
        bound = thread_cpus(daemons_[0].pid(), "kvtd-");
        return bound.count("kvtd-lane0") + bound.count("kvtd-lane1") + bound.count("kvtd-io0") == 3;
      },
      std::chrono::seconds(10));
  std::string names;
  for (const auto& [name, cpus] : bound) names += name + "=" + cpus + " ";
  EXPECT_TRUE(all_named) << names;
  for (const auto& [name, cpus] : bound) EXPECT_EQ(cpus, node0) << name;
  const auto log = test::read_file(log_path(1));
  EXPECT_NE(log.find("not bound to NUMA node 7"), std::string::npos) << log;
  std::filesystem::remove_all(store);
}

// One debug line per task (kind, status, blocks, bytes, queue wait, run time) and an info
// summary per period while tasks complete.
TEST_F(DaemonTest, EveryTaskGetsADebugLineAndBusyPeriodsASummary) {
  g_ = test::small_geometry(1);
  extra_args_ = {"--log-summary-period", "0.2"};
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2, 3}, {4, 5, 6}).ok());
  const std::uint64_t bytes = 3 * g_.bytes_per_block_all_layers();
  std::string log;
  ASSERT_TRUE(test::eventually(
      [&] {
        log = test::read_file(log_path(0));
        return log.find("last 0 s:") != std::string::npos || log.find("tasks ok, 0 failed") != std::string::npos;
      },
      std::chrono::seconds(10)))
      << log;
  EXPECT_NE(log.find(fmt::format("SWAP_TO_HOST ok: 3 blocks, {} bytes, queue wait ", bytes)),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("1 tasks ok, 0 failed"), std::string::npos) << log;
}

// The pool records its layout: a daemon restarted within the session with another
// --host-layout must not read page-first bytes as layer-first ones. It recreates the pool, and
// a load from a block of the old pool is host_tier_lost, never misplaced bytes.
TEST_F(DaemonTest, RestartWithAnotherHostLayoutLosesThePoolInsteadOfMisreadingIt) {
  g_ = test::small_geometry(1);
  extra_args_ = {"--host-layout", "page_first"};
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2}, {3, 4}).ok());
  kill(daemons_[0].pid(), SIGTERM);
  ASSERT_EQ(daemons_[0].wait_exit(std::chrono::seconds(30)), 0);
  extra_args_ = {"--host-layout", "layer_first"};
  daemons_[0] = start_daemon(0, 1);
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0, 1));
  auto r = run(TaskKind::kSwapToDevice, {3}, {5});
  EXPECT_EQ(r.status, TaskStatus::kHostTierLost) << (r.failures.empty() ? "" : r.failures[0].message);
  EXPECT_NE(test::read_file(log_path(0, 1)).find("does not match this session"), std::string::npos)
      << test::read_file(log_path(0, 1));
  // The new pool works: a fresh round trip through it is byte exact.
  round_trip({6, 7}, {8, 9}, {10, 11});
}

// A stray SIGUSR2 (the daemon's private "signal thread, exit" word) ended the signal thread, and
// the SIGTERM after it was never taken: the daemon served on until the service manager killed it.
TEST_F(DaemonTest, StraySigusr2DoesNotStopSigtermFromBeingHandled) {
  g_ = test::small_geometry(1);
  ASSERT_NO_FATAL_FAILURE(start_all());
  daemons_[0].signal(SIGUSR2);
  ASSERT_TRUE(test::eventually([&] { return test::read_file(log_path(0)).find("SIGUSR2 received") != std::string::npos; },
                             std::chrono::seconds(10)))
      << test::read_file(log_path(0));
  round_trip({1, 2}, {3, 4}, {5, 6});  // still serving
  daemons_[0].signal(SIGTERM);
  EXPECT_EQ(daemons_[0].wait_exit(std::chrono::seconds(20)), 0) << test::read_file(log_path(0));
}

TEST_F(DaemonTest, MalformedTasksGetErrorsAndTheNextTaskSucceeds) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  auto expect_failure = [&](std::uint64_t id, TaskStatus want, const char* words) {
    auto r = engine_->wait(id, 10'000'000'000);
    ASSERT_TRUE(r.ok()) << r.error().message;
    EXPECT_EQ(r->status, want) << proto::task_status_name(r->status);
    ASSERT_EQ(r->failures.size(), 2u) << "every rank reports the error";
    EXPECT_NE(r->failures[0].message.find(words), std::string::npos) << r->failures[0].message;
  };
  std::vector<std::int32_t> one{1}, two{1, 2};
  proto::TaskRecordHeader raw{};
  raw.kind = 77;
  raw.format_version = proto::kTaskFormatVersion;
  auto id = engine_->submit_raw(raw, one, one);
  ASSERT_TRUE(id.ok());
  expect_failure(*id, TaskStatus::kUnknownKind, "unknown task kind 77");

  raw.kind = static_cast<std::uint16_t>(TaskKind::kSwapToHost);
  raw.format_version = 99;
  id = engine_->submit_raw(raw, one, one);
  ASSERT_TRUE(id.ok());
  expect_failure(*id, TaskStatus::kBadVersion, "version 99");

  TaskRequest req;
  req.kind = TaskKind::kSwapToHost;
  req.src = two;
  req.dst = one;
  id = engine_->submit(req);
  ASSERT_TRUE(id.ok());
  expect_failure(*id, TaskStatus::kLengthMismatch, "2 ids");

  std::vector<std::int32_t> far{1000};
  req.src = far;
  req.dst = one;
  id = engine_->submit(req);
  ASSERT_TRUE(id.ok());
  expect_failure(*id, TaskStatus::kIdOutOfRange, "1000");

  std::vector<std::int32_t> dup{3, 3};
  req.src = two;
  req.dst = dup;
  id = engine_->submit(req);
  ASSERT_TRUE(id.ok());
  expect_failure(*id, TaskStatus::kDuplicateDestination, "destination");

  round_trip({4, 8}, {2, 3}, {4, 8});  // the daemons still serve
  EXPECT_TRUE(daemons_[0].running() && daemons_[1].running());
}

TEST_F(DaemonTest, EvictThenLoadOfTheSameHostBlockSeesTheEvictedBytes) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  // Submitted back to back without waiting: the load must run after the eviction it depends on.
  for (int it = 0; it < 20; ++it) {
    std::vector<std::int32_t> dev{it % 8, 10 + it % 8}, host{it % 5, 6 + it % 5}, dev2{20, 21};
    ASSERT_NO_FATAL_FAILURE(evict_then_load(dev, host, dev2));
    for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
      for (std::size_t i = 0; i < 2; ++i)
        ASSERT_EQ(loadgen::check_block(base + static_cast<std::uint64_t>(dev2[i]) * bb, bb, r, l, k,
                                       static_cast<std::uint32_t>(dev[i])),
                  -1);
    });
    fill_device();
  }
}

// Same as above with blocks large enough (8 layers x K+V x 64 KiB = 1 MiB per block) that no
// task runs inline on the dispatcher: the load waits for the eviction on the other lane only
// through the block tracker (conflicts()). With small blocks that path was never exercised.
TEST_F(DaemonTest, LargeEvictThenLoadOfTheSameHostBlocksCrossesLanesInOrder) {
  set_geometry(8, 64, 8, 32, 128, 32);
  ASSERT_NO_FATAL_FAILURE(start_all());
  for (int it = 0; it < 6; ++it) {
    std::vector<std::int32_t> dev(8), host(8), dev2(8);
    for (int i = 0; i < 8; ++i) {
      dev[i] = (it * 5 + i * 3) % 32;
      host[i] = (it * 7 + i) % 32;
      dev2[i] = 32 + i * 4 + it % 4;
    }
    ASSERT_NO_FATAL_FAILURE(evict_then_load(dev, host, dev2));
    for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
      for (std::size_t i = 0; i < dev.size(); ++i)
        ASSERT_EQ(loadgen::check_block(base + static_cast<std::uint64_t>(dev2[i]) * bb, bb, r, l, k,
                                       static_cast<std::uint32_t>(dev[i])),
                  -1)
            << "iteration " << it << " block " << dev2[i];
    });
    fill_device();
  }
}

// Within one direction tasks run in submission order: a small task (inline-sized) behind a
// large queued one on the same lane must not overtake it. Two evictions into the same host
// block: the later one's bytes must be what a load then finds.
TEST_F(DaemonTest, SmallTaskNeverOvertakesALargeOneQueuedOnItsLane) {
  set_geometry(8, 64, 2, 8, 128, 32);  // 4 KiB per block-tensor: 64 KiB per block
  ASSERT_NO_FATAL_FAILURE(start_all());
  std::vector<std::int32_t> big_ids(32);
  std::iota(big_ids.begin(), big_ids.end(), 0);
  for (int it = 0; it < 10; ++it) {
    // 2 MiB: queued on the lane. Then a 64 KiB eviction (small enough to run inline on the
    // dispatcher if its lane were idle) into the big one's last host block.
    const std::vector<std::int32_t> small_dev{40 + it}, small_host{31};
    TaskRequest big, small;
    big.kind = small.kind = TaskKind::kSwapToHost;
    big.src = big_ids;
    big.dst = big_ids;
    small.src = small_dev;
    small.dst = small_host;
    auto a = engine_->submit(big);
    auto b = engine_->submit(small);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE(engine_->wait(*a, 20'000'000'000)->ok());
    ASSERT_TRUE(engine_->wait(*b, 20'000'000'000)->ok());
    auto in = run(TaskKind::kSwapToDevice, small_host, {63});
    ASSERT_TRUE(in.ok());
    for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
      ASSERT_EQ(loadgen::check_block(base + 63ull * bb, bb, r, l, k, static_cast<std::uint32_t>(40 + it)), -1)
          << "the small eviction ran before the large one queued ahead of it (iteration " << it << ")";
    });
    fill_device();
  }
}

TEST_F(DaemonTest, LayerByLayerLoadReportsEveryLayerThenCompletes) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  std::vector<std::int32_t> dev{3, 4, 9}, host{0, 1, 2}, dev2{20, 5, 6};
  ASSERT_TRUE(run(TaskKind::kSwapToHost, dev, host).ok());
  for_each_tensor([&](std::uint32_t, std::uint32_t, std::uint32_t, std::byte* base, std::uint64_t bb) {
    for (auto b : dev) std::memset(base + static_cast<std::uint64_t>(b) * bb, 0xee, bb);
  });
  const std::uint64_t layered = submit(TaskKind::kSwapToDevice, host, dev2, /*layerwise=*/true);
  ASSERT_NE(layered, 0u);
  const auto* id = &layered;
  for (std::uint32_t l = 0; l < g_.num_layers; ++l) {
    auto queued = engine_->wait_layer(*id, l, 10'000'000'000, EngineSession::LayerStage::kEnqueued);
    ASSERT_TRUE(queued.ok()) << queued.error().message;
    auto st = engine_->wait_layer(*id, l, 10'000'000'000);
    ASSERT_TRUE(st.ok()) << st.error().message;
    // Layer l is in place on every rank as soon as wait_layer says so.
    for (std::uint32_t r = 0; r < g_.num_ranks; ++r) {
      const auto bb = g_.block_bytes(proto::TensorKind::kKey);
      auto* base = engine_->host_device_tensor(r, l, proto::TensorKind::kKey);
      for (std::size_t i = 0; i < dev2.size(); ++i)
        ASSERT_EQ(loadgen::check_block(base + static_cast<std::uint64_t>(dev2[i]) * bb, bb, r, l, 0,
                                       static_cast<std::uint32_t>(dev[i])),
                  -1);
    }
  }
  auto r = engine_->wait(*id, 10'000'000'000);
  ASSERT_TRUE(r.ok() && r->ok());
  EXPECT_EQ(engine_->wait_layer(*id, 0, 1'000'000).error().code, IpcErrc::kUnknownTask);
  EXPECT_FALSE(engine_->layer_event_handle(0, 0).has_value()) << "the host backend has no CUDA events";

  TaskRequest req;  // layer by layer is only for loads
  req.kind = TaskKind::kSwapToHost;
  req.src = host;
  req.dst = dev2;
  req.layerwise = true;
  auto refused = engine_->submit(req);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, IpcErrc::kInvalidArgument);

  proto::TaskRecordHeader raw{};
  raw.kind = static_cast<std::uint16_t>(TaskKind::kSwapToHost);
  raw.format_version = proto::kTaskFormatVersion;
  raw.flags = proto::kTaskFlagLayerwise;
  auto bad = engine_->submit_raw(raw, dev, host);
  ASSERT_TRUE(bad.ok());
  auto failed = engine_->wait_layer(*bad, 0, 10'000'000'000);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.error().code, IpcErrc::kTaskFailed);
  EXPECT_NE(failed.error().message.find("only valid on SWAP_TO_DEVICE"), std::string::npos) << failed.error().message;
}

TEST_F(DaemonTest, FlagsThatDisagreeWithTheSessionExitNonZeroNamingTheField) {
  ASSERT_NO_FATAL_FAILURE(start_engine());
  auto g = g_;
  g.num_layers = 5;
  Child bad(daemon_args(0, g), log_path(0));
  EXPECT_EQ(bad.wait_exit(std::chrono::seconds(20)), 3);
  const auto log = test::read_file(log_path(0));
  EXPECT_NE(log.find("num_layers"), std::string::npos) << log;
}

TEST_F(DaemonTest, BadFlagStopsStartupWithAMessage) {
  auto args = daemon_args(0, g_);
  args.push_back("--cache-dtype");
  args.push_back("fp4");
  Child bad(args, log_path(0));
  EXPECT_EQ(bad.wait_exit(std::chrono::seconds(20)), 2);
  EXPECT_NE(test::read_file(log_path(0)).find("--cache-dtype"), std::string::npos);
}

TEST_F(DaemonTest, DaemonStartedBeforeTheEngineAttachesWhenTheSessionAppears) {
  for (std::uint32_t r = 0; r < g_.num_ranks; ++r) daemons_.push_back(start_daemon(r));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_TRUE(daemons_[0].running());
  ASSERT_NO_FATAL_FAILURE(start_engine());
  ASSERT_TRUE(engine_->wait_ready(20'000'000'000).ok());
  round_trip({1, 2, 3}, {4, 5, 6}, {7, 8, 9});
}

TEST_F(DaemonTest, FullRingFailsSubmitAfterItsDeadline) {
  ASSERT_NO_FATAL_FAILURE(start_all(4096, 60'000'000'000));
  for (auto& d : daemons_) d.signal(SIGSTOP);  // ranks stop consuming but are not declared dead
  std::vector<std::int32_t> ids(100);
  std::iota(ids.begin(), ids.end(), 0);
  std::vector<std::int32_t> host(ids.begin(), ids.begin() + 20), dev(ids.begin(), ids.begin() + 20);
  TaskRequest req;
  req.kind = TaskKind::kSwapToHost;
  req.src = dev;
  req.dst = host;
  req.submit_timeout_ns = 100'000'000;
  std::vector<std::uint64_t> accepted;
  Result<std::uint64_t, IpcErrc> r = std::uint64_t{0};
  for (int i = 0; i < 1000; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    r = engine_->submit(req);
    if (!r.ok()) {
      EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(100));
      break;
    }
    accepted.push_back(*r);
  }
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, IpcErrc::kRingFull);
  EXPECT_NE(r.error().message.find("task ring full"), std::string::npos) << r.error().message;
  EXPECT_FALSE(accepted.empty());
  for (auto& d : daemons_) d.signal(SIGCONT);
  for (auto id : accepted) {
    auto res = engine_->wait(id, 10'000'000'000);
    ASSERT_TRUE(res.ok()) << res.error().message;
    EXPECT_TRUE(res->ok());
  }
}

TEST_F(DaemonTest, KilledRankIsReportedDeadAndItsPendingTasksFail) {
  ASSERT_NO_FATAL_FAILURE(start_all(1u << 16, 500'000'000));
  daemons_[1].signal(SIGSTOP);
  std::vector<std::int32_t> dev{1, 2}, host{3, 4};
  TaskRequest req;
  req.kind = TaskKind::kSwapToHost;
  req.src = dev;
  req.dst = host;
  auto id = engine_->submit(req);
  ASSERT_TRUE(id.ok());
  daemons_[1].signal(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = engine_->wait(*id, 10'000'000'000);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->status, TaskStatus::kRankDead);
  ASSERT_EQ(r->failures.size(), 1u);
  EXPECT_EQ(r->failures[0].rank, 1u);
  EXPECT_LT(waited, std::chrono::seconds(3));
  EXPECT_FALSE(engine_->rank_alive(1));
  EXPECT_TRUE(engine_->rank_alive(0));
  auto refused = engine_->submit(req);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, IpcErrc::kNotReady);
  // A restarted rank attaches under a new epoch and serves again.
  daemons_[1] = start_daemon(1, 1);
  ASSERT_TRUE(engine_->wait_ready(20'000'000'000).ok());
  round_trip({5, 6}, {7, 8}, {9, 10});
}

TEST_F(DaemonTest, SigtermFinishesTheTaskInFlightThenExitsZero) {
  test::Watchdog dog(240);  // bounds below are for sanitizer builds on a busy machine
  set_geometry(8, 64, 8, 64, 128, 64);  // 128 KiB block-tensors
  ASSERT_NO_FATAL_FAILURE(start_all());
  std::vector<std::int32_t> ids(64);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(1));
  TaskRequest req;
  req.kind = TaskKind::kSwapToHost;
  req.src = ids;
  req.dst = ids;
  auto id = engine_->submit(req);  // 128 MiB per rank
  ASSERT_TRUE(id.ok());
  // At once: the task is in the ring, perhaps not yet read by either rank. A task submitted
  // before SIGTERM is finished whether or not a rank had read it yet (this used to depend on
  // the task being read within 5 ms, and failed under TSan on a busy machine).
  for (auto& d : daemons_) d.signal(SIGTERM);
  auto r = engine_->wait(*id, 180'000'000'000);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(r->ok()) << (r->failures.empty() ? "" : r->failures[0].message);
  EXPECT_EQ(r->blocks_done, 64u);
  for (auto& d : daemons_) EXPECT_EQ(d.wait_exit(std::chrono::seconds(30)), 0);
  // An orderly exit is noticed at once, not after the heartbeat timeout (3 s here).
  EXPECT_TRUE(test::eventually([&] { return !engine_->rank_alive(0) && !engine_->rank_alive(1); },
                               std::chrono::milliseconds(500)));
  auto refused = engine_->submit(req);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, IpcErrc::kNotReady);
}

// SIGTERM finishes what was published before it, not everything that keeps arriving: an engine
// that never stops submitting must not keep a stopping daemon alive.
TEST_F(DaemonTest, SigtermExitsWhileTheEngineKeepsSubmitting) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> submitted{0};
  std::thread engine([&] {
    const std::vector<std::int32_t> one{1}, one_h{2};
    while (!done.load()) {
      TaskRequest req;
      req.kind = TaskKind::kSwapToHost;
      req.src = one;
      req.dst = one_h;
      req.submit_timeout_ns = 10'000'000;
      if (auto id = engine_->submit(req); id.ok()) {
        ++submitted;
        (void)engine_->poll(*id);
      }
    }
  });
  ASSERT_TRUE(test::eventually([&] { return submitted.load() > 1000; }, std::chrono::seconds(10)));
  for (auto& d : daemons_) d.signal(SIGTERM);
  for (auto& d : daemons_) EXPECT_EQ(d.wait_exit(std::chrono::seconds(20)), 0);
  done = true;
  engine.join();
}

TEST_F(DaemonTest, EngineThatLeavesIsFollowedByTheNextSession) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  round_trip({1}, {2}, {3});
  engine_.reset();  // the engine exits: the session is closed
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_TRUE(daemons_[0].running() && daemons_[1].running()) << "daemons must wait, not exit";
  ASSERT_NO_FATAL_FAILURE(start_engine());
  ASSERT_TRUE(engine_->wait_ready(20'000'000'000).ok());
  round_trip({4, 5}, {6, 7}, {8, 9});
  EXPECT_NE(test::read_file(log_path(0)).find("waiting for a new session"), std::string::npos);
}

TEST_F(DaemonTest, StaleEngineHeartbeatMakesTheDaemonDetach) {
  g_ = test::small_geometry(1);
  daemons_.push_back(start_daemon(0));
  // A separate engine process that we can freeze: the load generator in verify mode.
  Child engine({test::loadgen_binary(), "--session", suffix_, "--ranks", "1", "--layers", "3", "--kv-heads", "2",
                "--block-size", "4", "--head-dim", "8", "--device-blocks", "32", "--host-blocks", "24",
                "--iterations", "100000", "--blocks-per-task", "2"},
               log_path(9));
  ASSERT_TRUE(test::eventually([&] { return test::read_file(log_path(0)).find("serving") != std::string::npos; },
                               std::chrono::seconds(20)));
  engine.signal(SIGSTOP);  // heartbeat goes stale; --engine-timeout is 1 s
  ASSERT_TRUE(test::eventually(
      [&] { return test::read_file(log_path(0)).find("stopped heartbeating") != std::string::npos; },
      std::chrono::seconds(10)))
      << test::read_file(log_path(0));
  engine.signal(SIGKILL);
  EXPECT_EQ(engine.wait_exit(std::chrono::seconds(5)), 128 + SIGKILL);
  // The dead engine left its segment behind; a new engine replaces it and the daemon follows.
  ASSERT_NO_FATAL_FAILURE(start_engine());
  ASSERT_TRUE(engine_->wait_ready(20'000'000'000).ok()) << test::read_file(log_path(0));
  round_trip({1, 2}, {3, 4}, {5, 6});
  EXPECT_TRUE(daemons_[0].running());
}

}  // namespace
}  // namespace kvtd

namespace kvtd {
namespace {

TEST(DaemonBinary, CudaBackendWithoutAGpuStopsWithAClearMessage) {
  const std::string log = ::testing::TempDir() + "/kvtd_cuda_nogpu.log";
  test::Child d({test::kvtd_binary(), "--rank", "0", "--key-cache-shape", "8,1,4,8", "--session",
                 test::unique_suffix("nogpu"), "--device-backend", "cuda", "--attach-timeout", "1"},
                log);
  const int code = d.wait_exit(std::chrono::seconds(20));
  const auto text = test::read_file(log);
  if (code == 4) GTEST_SKIP() << "a GPU is present: the backend started and waited for a session";
  EXPECT_EQ(code, 5) << text;
  EXPECT_NE(text.find("--device-backend cuda"), std::string::npos) << text;
}

}  // namespace
}  // namespace kvtd
