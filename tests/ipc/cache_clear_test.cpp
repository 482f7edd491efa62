// Weight updates: clear_caches() releases every daemon mapping of the engine's KV
// tensors, the engine frees them and makes new ones, restore_caches() maps the new ones, and
// swaps through them are byte exact. Real daemons; the host backend's "device" arenas are
// shared-memory objects, so /proc/<pid>/maps shows exactly what each daemon has mapped.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <filesystem>

#include "daemon_fixture.h"

namespace kvtd {
namespace {

class CacheClearTest : public DaemonTest {
 protected:
  // The shared-memory name of rank r's host-backend arena of the given incarnation.
  std::string arena(std::uint32_t rank, std::uint32_t incarnation) const {
    char buf[96];
    std::snprintf(buf, sizeof buf, "kvtd_%u_%016" PRIx64 "_dev%u", static_cast<unsigned>(getuid()),
                  engine_->generation(), incarnation * 1000 + rank);
    return buf;
  }
  static bool maps(const Child& daemon, const std::string& object) {
    return test::read_file(fmt::format("/proc/{}/maps", daemon.pid())).find("/" + object) != std::string::npos;
  }
  // While cleared: the engine makes new tensors, rank 1's daemon starts again, attaches (host
  // pool ready, cache not) and maps none of them.
  void new_tensors_then_restart_rank1() {
    ASSERT_TRUE(engine_->create_host_device_tensors().ok());
    fill_device();
    daemons_[1] = start_daemon(1, 1);
    ASSERT_TRUE(test::eventually([&] { return engine_->rank_ready_flags(1) == proto::kReadyHostPool; },
                                 std::chrono::seconds(30)))
        << test::read_file(log_path(1, 1));
    EXPECT_FALSE(maps(daemons_[1], arena(1, 1)));
  }
  void expect_status(const engine::TaskResult& r, TaskStatus want) {
    EXPECT_EQ(r.status, want) << (r.failures.empty() ? std::string("ok") : r.failures[0].message);
  }
};

TEST_F(CacheClearTest, ClearReleasesEveryMappingAndRestoreServesTheNewTensorsByteExact) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2, 3}, {4, 5, 6}).ok());  // KV in the host tier
  for (std::uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(maps(daemons_[r], arena(r, 0))) << "the check must see mappings";

  // A task submitted just before the clear still completes: the clear waits for it.
  const auto before = submit(TaskKind::kSwapToHost, {7, 8}, {9, 10});
  auto cleared = engine_->clear_caches();
  ASSERT_TRUE(cleared.ok()) << cleared.error().message;
  auto b = engine_->wait(before, 10'000'000'000);
  ASSERT_TRUE(b.ok() && b->ok());
  EXPECT_TRUE(engine_->cache_cleared());
  for (std::uint32_t r = 0; r < 2; ++r) {
    EXPECT_FALSE(maps(daemons_[r], arena(r, 0))) << "rank " << r << " still maps its tensors after the clear";
    EXPECT_EQ(engine_->rank_ready_flags(r), proto::kReadyHostPool) << "a cleared rank is not cache-ready";
  }

  // Nothing runs meanwhile: refused by the engine, and failed by the daemons if it gets through.
  TaskRequest swap;
  swap.kind = TaskKind::kSwapToDevice;
  std::vector<std::int32_t> h4{4}, d0{0};
  swap.src = h4;
  swap.dst = d0;
  auto refused = engine_->submit(swap);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, IpcErrc::kCacheCleared);
  proto::TaskRecordHeader raw{};
  raw.kind = static_cast<std::uint16_t>(TaskKind::kSwapToDevice);
  raw.format_version = proto::kTaskFormatVersion;
  raw.num_src = raw.num_dst = 1;
  auto raw_id = engine_->submit_raw(raw, h4, d0);
  ASSERT_TRUE(raw_id.ok());
  auto raw_result = engine_->wait(*raw_id, 10'000'000'000);
  ASSERT_TRUE(raw_result.ok());
  expect_status(*raw_result, TaskStatus::kCacheCleared);
  EXPECT_EQ(raw_result->failures.size(), 2u) << "every rank fails it";

  // The engine frees its tensors (the arenas are unlinked) and makes new ones.
  ASSERT_TRUE(engine_->free_host_device_tensors().ok());
  for (std::uint32_t r = 0; r < 2; ++r) EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + arena(r, 0)));
  ASSERT_TRUE(engine_->create_host_device_tensors().ok());
  for_each_tensor([&](std::uint32_t, std::uint32_t l, std::uint32_t, std::byte* base, std::uint64_t bb) {
    std::memset(base, 0x5a, bb * static_cast<std::uint64_t>(g_.device_blocks(l)));
  });
  auto restored = engine_->restore_caches();
  ASSERT_TRUE(restored.ok()) << restored.error().message;
  EXPECT_FALSE(engine_->cache_cleared());
  ASSERT_TRUE(engine_->wait_ready(10'000'000'000).ok());
  for (std::uint32_t r = 0; r < 2; ++r) EXPECT_TRUE(maps(daemons_[r], arena(r, 1))) << "rank " << r;

  // The host tier survived the clear: its blocks load into the new tensors, byte for byte, and
  // nothing else of the new tensors changed.
  auto in = run(TaskKind::kSwapToDevice, {4, 5, 6}, {10, 11, 12});
  ASSERT_TRUE(in.ok()) << (in.failures.empty() ? "" : in.failures[0].message);
  for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
    for (std::int64_t blk = 0; blk < g_.device_blocks(l); ++blk) {
      const std::byte* p = base + static_cast<std::uint64_t>(blk) * bb;
      if (blk >= 10 && blk <= 12) {
        ASSERT_EQ(loadgen::check_block(p, bb, r, l, k, static_cast<std::uint32_t>(blk - 9)), -1)
            << "rank " << r << " layer " << l << " block " << blk;
      } else {
        for (std::uint64_t i = 0; i < bb; ++i) ASSERT_EQ(p[i], std::byte{0x5a}) << "block " << blk << " was written";
      }
    }
  });
  fill_device();
  round_trip({1, 2, 20}, {0, 1, 2}, {3, 4, 5});
}

TEST_F(CacheClearTest, DroppedHostTierIsLostAfterRestoreAndTheWeightVersionMoves) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {2}).ok());
  engine::ClearOptions o;
  o.drop_host_tier = true;
  o.weight_version = 7;
  auto cleared = engine_->clear_caches(o);
  ASSERT_TRUE(cleared.ok()) << cleared.error().message;
  EXPECT_EQ(engine_->weight_version(), 7u);
  auto again = engine_->clear_caches();  // clearing a cleared cache is fine
  ASSERT_TRUE(again.ok()) << again.error().message;
  // Same tensors (nothing re-registered): restore maps them again.
  auto restored = engine_->restore_caches();
  ASSERT_TRUE(restored.ok()) << restored.error().message;
  expect_status(run(TaskKind::kSwapToDevice, {2}, {3}), TaskStatus::kHostTierLost);
  round_trip({4}, {5}, {6});
  auto twice = engine_->restore_caches();
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.error().code, IpcErrc::kInvalidArgument);
}

TEST_F(CacheClearTest, DaemonThatAttachesWhileClearedMapsNothingUntilRestore) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(engine_->clear_caches().ok());
  // Rank 1 restarts during the weight update.
  kill(daemons_[1].pid(), SIGTERM);
  ASSERT_EQ(daemons_[1].wait_exit(std::chrono::seconds(30)), 0);
  ASSERT_NO_FATAL_FAILURE(new_tensors_then_restart_rank1());
  EXPECT_FALSE(maps(daemons_[1], arena(1, 0)));
  auto restored = engine_->restore_caches();
  ASSERT_TRUE(restored.ok()) << restored.error().message;
  EXPECT_TRUE(maps(daemons_[1], arena(1, 1)));
  round_trip({1, 2}, {3, 4}, {5, 6});
}

// A daemon stopped (SIGTERM) while the cache was cleared removed its host pool: the serving loop
// still held the clear as the reason the last mapping ended, so the stop read as "session over".
// The host tier of that rank was lost for its successor, and every load from it failed
// host_tier_lost after the restore.
TEST_F(CacheClearTest, ADaemonStoppedWhileClearedLeavesItsHostPoolToItsSuccessor) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2}, {3, 4}).ok());
  ASSERT_TRUE(engine_->clear_caches().ok());
  kill(daemons_[1].pid(), SIGTERM);
  ASSERT_EQ(daemons_[1].wait_exit(std::chrono::seconds(30)), 0);
  ASSERT_NO_FATAL_FAILURE(new_tensors_then_restart_rank1());
  auto restored = engine_->restore_caches();
  ASSERT_TRUE(restored.ok()) << restored.error().message;
  auto in = run(TaskKind::kSwapToDevice, {3, 4}, {5, 6});
  expect_status(in, TaskStatus::kOk);
  EXPECT_NE(test::read_file(log_path(1, 1)).find("re-mapped from a previous daemon"), std::string::npos)
      << test::read_file(log_path(1, 1));
}

// kill -9 of a rank around the clear: a dead rank holds no mapping, so the clear completes for
// the others (the engine fences the dead one first: until then clear says not_ready); the rank's
// restarted daemon attaches to the cleared session and maps nothing until the restore.
TEST_F(CacheClearTest, ARankKilledAroundTheClearCountsAsReleased) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  daemons_[1].signal(SIGKILL);
  engine::ClearOptions o;
  o.timeout_ns = 20'000'000'000;
  Result<engine::TaskResult, IpcErrc> cleared = make_error(IpcErrc::kNotReady, "not tried");
  ASSERT_TRUE(test::eventually(
      [&] {
        cleared = engine_->clear_caches(o);
        return cleared.ok() || cleared.error().code != IpcErrc::kNotReady;
      },
      std::chrono::seconds(30)));
  ASSERT_TRUE(cleared.ok()) << cleared.error().message;
  EXPECT_FALSE(maps(daemons_[0], arena(0, 0)));
  ASSERT_NO_FATAL_FAILURE(new_tensors_then_restart_rank1());
  auto restored = engine_->restore_caches();
  ASSERT_TRUE(restored.ok()) << restored.error().message;
  round_trip({1, 2}, {3, 4}, {5, 6});
}

TEST_F(CacheClearTest, RestoreThatCannotOpenTheNewTensorsFailsNamingTheRankAndStaysCleared) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(engine_->clear_caches().ok());
  // Rank 1's key tensor of layer 0 now names an arena that does not exist.
  proto::TensorDesc d{};
  d.rank = 1;
  d.layer = 0;
  d.kind = static_cast<std::uint32_t>(proto::TensorKind::kKey);
  d.device_id = -1;
  d.ndim = 4;
  for (int i = 0; i < 4; ++i) d.shape[i] = g_.key_shape[i];
  d.bytes = g_.block_bytes(proto::TensorKind::kKey) * static_cast<std::uint64_t>(g_.device_blocks(0));
  const std::string missing = arena(1, 9);
  std::memcpy(d.handle, missing.c_str(), missing.size() + 1);
  ASSERT_TRUE(engine_->register_tensor(d).ok());
  auto restored = engine_->restore_caches();
  ASSERT_FALSE(restored.ok());
  EXPECT_EQ(restored.error().code, IpcErrc::kTaskFailed);
  EXPECT_NE(restored.error().message.find("rank 1"), std::string::npos) << restored.error().message;
  EXPECT_TRUE(engine_->cache_cleared());
  // Fixed: clear (rank 0 had re-opened), register the real tensors again, restore.
  ASSERT_TRUE(engine_->clear_caches().ok());
  ASSERT_TRUE(engine_->create_host_device_tensors().ok());
  fill_device();
  auto fixed = engine_->restore_caches();
  ASSERT_TRUE(fixed.ok()) << fixed.error().message;
  round_trip({1}, {2}, {3});
}


// Trust round 4: an engine that shrinks its memory after attach (a truncated /dev/shm arena here;
// sglang's memfd pool the same) made the daemon's next copy a SIGBUS: the daemon died, and its
// restart refused the smaller file, in a loop. The copy now fails its task naming the cause, and
// the daemon serves on. Fails on the old code (rank 0's daemon killed by SIGBUS).
TEST_F(CacheClearTest, MemoryTheEngineShrankFailsTheTaskAndTheDaemonServesOn) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {4}).ok());  // rank 0 maps its arena and copies from it
  const int fd = shm_open(("/" + arena(0, 0)).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << arena(0, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);  // from here the test must not touch the engine's arenas either
  close(fd);
  // Out of the arena into free host blocks, then host block 4 (stored above) back into it.
  const std::vector<std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>> blocks{{{2, 3}, {5, 6}}, {{4}, {7}}};
  for (const auto kind : {TaskKind::kSwapToHost, TaskKind::kSwapToDevice}) {
    const auto& [src, dst] = blocks[kind == TaskKind::kSwapToHost ? 0 : 1];
    const auto r = run(kind, src, dst);
    EXPECT_EQ(r.status, TaskStatus::kDeviceError) << (r.failures.empty() ? "ok" : r.failures[0].message);
    ASSERT_FALSE(r.failures.empty());
    EXPECT_EQ(r.failures[0].rank, 0u);
    EXPECT_NE(r.failures[0].message.find("memory shrank"), std::string::npos) << r.failures[0].message;
  }
  EXPECT_TRUE(daemons_[0].running()) << "rank 0's daemon died: " << test::read_file(log_path(0));
  EXPECT_TRUE(engine_->rank_alive(0));
}

}  // namespace
}  // namespace kvtd
