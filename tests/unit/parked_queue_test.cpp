// The dispatcher's parked queue (daemon/serve/parked_queue.h) in-process, with a real block
// tracker: which parked work may overtake which, and what a CANCEL of a parked task leaves.
#include "parked_queue.h"

#include <gtest/gtest.h>

#include <vector>

#include "block_tracker.h"

namespace kvtd::daemon {
namespace {

using proto::TaskKind;
constexpr Lane kToHost = Lane::kToHost, kToDevice = Lane::kToDevice, kStorage = Lane::kStorage;

Work swap(std::uint64_t id, TaskKind kind, std::vector<std::int32_t> host, std::vector<std::int32_t> device) {
  Work w;
  w.header.task_id = id;
  w.header.kind = static_cast<std::uint16_t>(kind);
  w.host_ids = std::move(host);
  w.device_ids = std::move(device);
  return w;
}

// A STORAGE_WRITE (it reads its blocks) or STORAGE_READ (it writes them) of host blocks.
Work storage(std::uint64_t id, TaskKind kind, std::vector<std::int32_t> host) {
  Work w = swap(id, kind, host, {});
  w.storage = true;
  w.storage_work.header = w.header;
  w.storage_work.blocks = std::move(host);
  return w;
}

struct Fixture {
  BlockTracker tracker{16, 16};
  ParkedQueue parked{16, 16};
  std::vector<std::uint64_t> started;

  // What the dispatcher does with a decoded task: start it, or park it.
  void offer(Work&& w, Lane lane) {
    if (parked.must_wait(w) || !tracker.try_admit(tracked_task(w), lane)) {
      parked.park(std::move(w), lane);
      return;
    }
    started.push_back(w.header.task_id);
  }
  std::size_t retry() {
    return parked.release_ready([&](const Work& w, Lane lane) { return tracker.try_admit(tracked_task(w), lane); },
                                [&](Work&& w, Lane) { started.push_back(w.header.task_id); });
  }
};

TEST(ParkedQueue, WorkOnOtherBlocksOvertakesAParkedTaskAndTheParkedOneGoesOnRelease) {
  Fixture f;
  const Work evict = swap(1, TaskKind::kSwapToHost, {3}, {0});
  ASSERT_TRUE(f.tracker.try_admit(tracked_task(evict), kToHost));  // in flight
  f.offer(swap(2, TaskKind::kSwapToDevice, {3}, {5}), kToDevice);   // reads host 3 while it is written
  f.offer(swap(3, TaskKind::kSwapToDevice, {4}, {6}), kToDevice);   // other blocks
  EXPECT_EQ(f.started, (std::vector<std::uint64_t>{3}));
  EXPECT_EQ(f.retry(), 0u) << "nothing was released";
  f.tracker.release(tracked_task(evict), kToHost);
  EXPECT_EQ(f.retry(), 1u);
  EXPECT_EQ(f.started, (std::vector<std::uint64_t>{3, 2}));
  EXPECT_TRUE(f.parked.empty());
}

TEST(ParkedQueue, ConflictingWorkStaysBehindAParkedTaskEvenOnTheSameLane) {
  Fixture f;
  const Work evict = swap(1, TaskKind::kSwapToHost, {3}, {0});
  ASSERT_TRUE(f.tracker.try_admit(tracked_task(evict), kToHost));
  f.offer(swap(2, TaskKind::kSwapToDevice, {3}, {5}), kToDevice);  // parked: writes device 5
  f.offer(swap(3, TaskKind::kSwapToHost, {9}, {5}), kToHost);      // reads device 5: behind task 2
  Work after = swap(4, TaskKind::kSwapToDevice, {10}, {11});
  after.header.after_task_id = 2;                                  // names the parked task
  f.offer(std::move(after), kToDevice);
  f.offer(swap(5, TaskKind::kSwapToDevice, {3}, {12}), kToDevice);  // reads host 3 too: no conflict with 2
  EXPECT_EQ(f.parked.size(), 4u) << "task 5 still waits for the eviction in flight";
  EXPECT_TRUE(f.started.empty());
  f.tracker.release(tracked_task(evict), kToHost);
  f.retry();
  // 2 goes, then 4 (it names 2, which now runs ahead of it on the same lane, in order) and 5
  // (read/read); 3 conflicts with 2 in flight on the other lane.
  EXPECT_EQ(f.started, (std::vector<std::uint64_t>{2, 4, 5}));
  EXPECT_EQ(f.parked.size(), 1u);
}

TEST(ParkedQueue, StorageTasksKeepRingOrderBehindAParkedStorageTask) {
  Fixture f;
  const Work evict = swap(1, TaskKind::kSwapToHost, {3}, {0});
  ASSERT_TRUE(f.tracker.try_admit(tracked_task(evict), kToHost));
  f.offer(storage(2, TaskKind::kStorageWrite, {3}), kStorage);  // its backup: waits for the eviction
  f.offer(storage(3, TaskKind::kStorageRead, {7}), kStorage);   // other blocks, but a storage task
  f.offer(swap(4, TaskKind::kSwapToDevice, {8}, {9}), kToDevice);
  EXPECT_EQ(f.started, (std::vector<std::uint64_t>{4})) << "the agreement thread must meet 2 before 3";
  f.tracker.release(tracked_task(evict), kToHost);
  f.retry();
  EXPECT_EQ(f.started, (std::vector<std::uint64_t>{4, 2, 3}));
}

TEST(ParkedQueue, ALoadIsNotOrderedBehindABackupThatOnlyReadsItsHostBlock) {
  Fixture f;
  const Work backup = storage(1, TaskKind::kStorageWrite, {3});
  ASSERT_TRUE(f.tracker.try_admit(tracked_task(backup), kStorage));  // slow store: still in flight
  f.offer(swap(2, TaskKind::kSwapToDevice, {3}, {5}), kToDevice);
  EXPECT_EQ(f.started, (std::vector<std::uint64_t>{2}));
  f.offer(swap(3, TaskKind::kSwapToHost, {3}, {6}), kToHost);  // overwriting host 3 must wait
  EXPECT_EQ(f.parked.size(), 1u);
}

TEST(ParkedQueue, CancelRemovesAParkedSwapButKeepsAParkedStorageTaskInPlaceWithoutBlocks) {
  Fixture f;
  const Work evict = swap(1, TaskKind::kSwapToHost, {3, 4}, {0});
  ASSERT_TRUE(f.tracker.try_admit(tracked_task(evict), kToHost));
  f.offer(swap(2, TaskKind::kSwapToDevice, {3}, {5}), kToDevice);
  f.offer(storage(3, TaskKind::kStorageRead, {4}), kStorage);
  f.offer(storage(4, TaskKind::kStorageRead, {10}), kStorage);  // behind 3 (storage order)
  auto h2 = f.parked.cancel(2);
  ASSERT_TRUE(h2.has_value());
  EXPECT_EQ(h2->task_id, 2u);
  EXPECT_FALSE(f.parked.cancel(2).has_value()) << "gone";
  auto h3 = f.parked.cancel(3);
  ASSERT_TRUE(h3.has_value());
  EXPECT_FALSE(f.parked.cancel(3).has_value()) << "answered once";
  EXPECT_FALSE(f.parked.cancel(99).has_value());
  // The cancelled storage task conflicts with nothing now: it and the one behind it go at once,
  // in ring order, while the eviction is still in flight.
  f.retry();
  EXPECT_EQ(f.started, (std::vector<std::uint64_t>{3, 4}));
  EXPECT_TRUE(f.parked.empty());
}

TEST(ParkedQueue, TakeAllEmptiesItAndLeavesNoCountsBehind) {
  Fixture f;
  const Work evict = swap(1, TaskKind::kSwapToHost, {3}, {0});
  ASSERT_TRUE(f.tracker.try_admit(tracked_task(evict), kToHost));
  f.offer(swap(2, TaskKind::kSwapToDevice, {3}, {5}), kToDevice);
  f.offer(storage(3, TaskKind::kStorageRead, {3}), kStorage);
  EXPECT_EQ(f.parked.take_all().size(), 2u);
  EXPECT_TRUE(f.parked.empty());
  EXPECT_FALSE(f.parked.must_wait(swap(4, TaskKind::kSwapToHost, {3}, {5}))) << "no parked blocks remain";
  EXPECT_FALSE(f.parked.must_wait(storage(5, TaskKind::kStorageRead, {1})));
}

}  // namespace
}  // namespace kvtd::daemon
