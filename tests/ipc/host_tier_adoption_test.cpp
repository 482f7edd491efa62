// A restarted engine worker takes over its dead predecessor's host tier
// (SessionOptions::adopt_host_tier): the daemon keeps the dead engine's pool, naming itself its
// holder, and renames it to the new session's name with its blocks when that session asks
// (HostPool::open's take_over_generation). Before, a dead engine's pools were removed by the
// daemon and every later load of those host blocks failed host_tier_lost, though the engine's
// scheduler (a separate process that lived on) still named them; and then, while the engine
// found its predecessor itself, any other engine's session created in between swept the dead
// session and its pool first.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <vector>

#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/engine/engine_session.h"
#include "kvtd/ipc/segment.h"
#include "kvtd/proto/names.h"
#include "kvtd/ipc/shared_object.h"
#include "test_support.h"

namespace kvtd::daemon {
namespace {

using engine::EngineSession;
using engine::SessionOptions;

bool exists(const std::string& name) {
  struct stat st {};
  return lstat(("/dev/shm/" + name).c_str(), &st) == 0;
}

std::string pool_name(std::uint64_t generation) {
  return ipc::session_object_name(generation, proto::host_pool_object(0, 0));
}

// A pool of generation `gen` with blocks 1 and 3 written and valid, closed (not removed), as a
// dead session's daemon leaves it.
void leave_pool(HostMemory& backend, const proto::CacheGeometry& g, std::uint64_t gen) {
  auto pool = HostPool::open(backend, g, gen, 0);
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  const std::int32_t ids[] = {1, 3};
  (*pool)->mark_invalid(ids);
  std::memset((*pool)->region(0, proto::TensorKind::kKey) + (*pool)->stride(proto::TensorKind::kKey), 0x5a,
              (*pool)->stride(proto::TensorKind::kKey));
  (*pool)->mark_valid(ids);
}

TEST(HostTierAdoption, ADaemonTakesOverTheDeadSessionsPoolWithItsBlocks) {
  auto backend = make_host_backend();
  const auto g = test::small_geometry(1);
  const std::uint64_t dead = 0x7a00000000000000ull + getpid(), next = dead + 1;
  leave_pool(*backend, g, dead);
  auto pool = HostPool::open(*backend, PoolShape::of(g), next, 0, 0, HostLayout::kLayerFirst, -1, {}, {}, dead);
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  EXPECT_EQ((*pool)->adopted(), dead);
  EXPECT_TRUE((*pool)->restored());
  EXPECT_EQ((*pool)->valid_blocks(), 2u);
  const std::int32_t written[] = {1, 3}, never[] = {0};
  EXPECT_FALSE((*pool)->first_invalid(written).has_value());
  EXPECT_TRUE((*pool)->first_invalid(never).has_value());
  const std::byte* b1 = (*pool)->region(0, proto::TensorKind::kKey) + (*pool)->stride(proto::TensorKind::kKey);
  EXPECT_EQ(static_cast<unsigned char>(b1[0]), 0x5a);
  EXPECT_FALSE(exists(pool_name(dead))) << "the dead session's name must be gone (renamed)";
  EXPECT_TRUE(exists(pool_name(next)));
  (*pool)->remove();
}

TEST(HostTierAdoption, APoolOfAnotherShapeIsNotTakenOver) {
  auto backend = make_host_backend();
  auto g = test::small_geometry(1);
  const std::uint64_t dead = 0x7b00000000000000ull + getpid(), next = dead + 1;
  leave_pool(*backend, g, dead);
  g.num_host_blocks += 4;
  auto pool = HostPool::open(*backend, PoolShape::of(g), next, 0, 0, HostLayout::kLayerFirst, -1, {}, {}, dead);
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  EXPECT_EQ((*pool)->adopted(), 0u);
  EXPECT_EQ((*pool)->valid_blocks(), 0u);
  EXPECT_TRUE(exists(pool_name(dead))) << "left for the sweep";
  (*pool)->remove();
  ipc::SharedObject::remove(pool_name(dead));
}

// Leaves a pool of generation `gen` (no session has it) whose holder daemon is dead.
void leave_pool_of_a_dead_daemon(const proto::CacheGeometry& g, std::uint64_t gen) {
  ASSERT_TRUE(test::in_dead_child([&] {
    auto backend = make_host_backend();
    return HostPool::open(*backend, g, gen, 0).ok();  // the object stays: only remove() unlinks it
  }));
}

// Sweeps until a sweep ran: another test's session mid-creation stops one (by design).
void sweep_until(const std::function<bool()>& done) {
  EXPECT_TRUE(test::eventually([&] {
    (void)ipc::sweep_stale_objects();
    return done();
  }, std::chrono::seconds(10)));
}

TEST(HostTierAdoption, ADeadEnginesPoolKeptByALiveDaemonSurvivesOtherEnginesSweeps) {
  auto backend = make_host_backend();
  const auto g = test::small_geometry(1);
  const std::uint64_t kept = 0x7c00000000000000ull + getpid(), orphan = kept + 1;
  // Kept: this process is the daemon that holds it. Orphan: its daemon died with it.
  ASSERT_NO_FATAL_FAILURE(leave_pool(*backend, g, kept));
  ASSERT_NO_FATAL_FAILURE(leave_pool_of_a_dead_daemon(g, orphan));
  ASSERT_TRUE(test::make_hour_old(pool_name(kept)));
  ASSERT_TRUE(test::make_hour_old(pool_name(orphan)));
  // Another engine's session: its create sweeps what dead sessions left.
  SessionOptions o;
  o.suffix = test::unique_suffix("sweeper");
  o.geometry = g;
  auto other = EngineSession::create(o);
  ASSERT_TRUE(other.ok()) << other.error().message;
  sweep_until([&] { return !exists(pool_name(orphan)); });
  EXPECT_TRUE(exists(pool_name(kept))) << "swept while the daemon that keeps it for the engine's restart lives";
  ipc::SharedObject::remove(pool_name(kept));
  ipc::SharedObject::remove(pool_name(orphan));
}

TEST(HostTierAdoption, TheEngineAsksItsDaemonsToTakeOverWithAFlag) {
  SessionOptions o;
  o.suffix = test::unique_suffix("adopt");
  o.geometry = test::small_geometry(1);
  o.adopt_host_tier = true;
  auto s = EngineSession::create(o);
  ASSERT_TRUE(s.ok()) << s.error().message;
  auto seg = ipc::SharedObject::open(ipc::detail::session_name(o.suffix));
  ASSERT_TRUE(seg.ok());
  const auto* h = reinterpret_cast<const proto::SessionHeader*>((*seg)->data());
  EXPECT_EQ(h->take_over_host_tier, 1u) << "the daemon, not the engine, knows what it kept: a flag";
  o.suffix += "n";
  o.adopt_host_tier = false;
  auto plain = EngineSession::create(o);
  ASSERT_TRUE(plain.ok()) << plain.error().message;
  auto plain_seg = ipc::SharedObject::open(ipc::detail::session_name(o.suffix));
  ASSERT_TRUE(plain_seg.ok());
  EXPECT_EQ(reinterpret_cast<const proto::SessionHeader*>((*plain_seg)->data())->take_over_host_tier, 0u);
}

}  // namespace
}  // namespace kvtd::daemon
