// A restarted engine worker takes over its dead predecessor's host tier
// (SessionOptions::adopt_host_tier): the engine finds the dead session of its suffix with the
// same geometry (ipc::detail::adoptable_generation), keeps its pools from the sweep, and each
// daemon renames the pool to the new session's name with its blocks (HostPool::open's
// adopt_generation). Before, a dead engine's pools were removed by the daemon and every later
// load of those host blocks failed host_tier_lost, though the engine's scheduler (a separate
// process that lived on) still named them.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
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

// An object an hour old: the sweep spares what was touched in the last 30 s.
void leave_old_object(const std::string& name) {
  ASSERT_TRUE(ipc::SharedObject::create(name, 4096).ok());
  ASSERT_TRUE(test::make_hour_old(name));
}

// The generation a child engine's session had, after the child died without closing it.
std::uint64_t dead_engine_session(const std::string& suffix, const proto::CacheGeometry& g) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  if (child == 0) {
    SessionOptions o;
    o.suffix = suffix;
    o.geometry = g;
    auto s = EngineSession::create(o);
    const std::uint64_t gen = s.ok() ? (*s)->generation() : 0;
    (void)!write(fds[1], &gen, sizeof gen);
    _exit(0);  // dies with the session open: nothing orderly runs
  }
  close(fds[1]);
  std::uint64_t gen = 0;
  EXPECT_EQ(read(fds[0], &gen, sizeof gen), static_cast<ssize_t>(sizeof gen));
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  return gen;
}

TEST(HostTierAdoption, TheEngineFindsItsDeadPredecessorWithTheSameGeometryOnly) {
  const auto suffix = test::unique_suffix("adopt");
  const auto g = test::small_geometry(1);
  const std::uint64_t dead = dead_engine_session(suffix, g);
  ASSERT_NE(dead, 0u);
  const std::string name = ipc::detail::session_name(suffix);
  EXPECT_EQ(ipc::detail::adoptable_generation(name, g, {}), dead);
  auto other = g;
  other.num_host_blocks += 1;
  EXPECT_EQ(ipc::detail::adoptable_generation(name, other, {}), 0u) << "another geometry";
  EXPECT_EQ(ipc::detail::adoptable_generation(ipc::detail::session_name(suffix + "x"), g, {}), 0u) << "no segment";

  // Its pool survives the new session's sweep and the new session names it for its daemons.
  const std::string dead_pool = pool_name(dead);
  ASSERT_NO_FATAL_FAILURE(leave_old_object(dead_pool));
  SessionOptions o;
  o.suffix = suffix;
  o.geometry = g;
  o.adopt_host_tier = true;
  auto s = EngineSession::create(o);
  ASSERT_TRUE(s.ok()) << s.error().message;
  EXPECT_EQ((*s)->adopted_generation(), dead);
  EXPECT_TRUE(exists(dead_pool)) << "swept although the new session takes it over";
  // A live engine's session is never taken over.
  EXPECT_EQ(ipc::detail::adoptable_generation(name, g, {}), 0u);
  ipc::SharedObject::remove(dead_pool);
}

TEST(HostTierAdoption, WithoutTheOptionTheDeadSessionsPoolIsSwept) {
  const auto suffix = test::unique_suffix("noadopt");
  const auto g = test::small_geometry(1);
  const std::uint64_t dead = dead_engine_session(suffix, g);
  ASSERT_NE(dead, 0u);
  const std::string dead_pool = pool_name(dead);
  ASSERT_NO_FATAL_FAILURE(leave_old_object(dead_pool));
  SessionOptions o;
  o.suffix = suffix;
  o.geometry = g;
  auto s = EngineSession::create(o);
  ASSERT_TRUE(s.ok()) << s.error().message;
  EXPECT_EQ((*s)->adopted_generation(), 0u);
  // Another test's session mid-creation may stop one sweep (by design): sweep until it ran.
  EXPECT_TRUE(test::eventually([&] {
    (void)ipc::sweep_stale_objects();
    return !exists(dead_pool);
  }, std::chrono::seconds(10)));
  ipc::SharedObject::remove(dead_pool);
}

}  // namespace
}  // namespace kvtd::daemon
