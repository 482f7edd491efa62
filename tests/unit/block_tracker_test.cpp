// The block tracker (daemon/serve/block_tracker.h) in-process: which work waits for which.
#include "block_tracker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "test_support.h"

namespace kvtd::daemon {
namespace {

constexpr Lane kToHost = Lane::kToHost, kToDevice = Lane::kToDevice, kStorage = Lane::kStorage;

struct Task {
  std::uint64_t id;
  std::vector<std::int32_t> host, device;
  std::uint64_t after = 0;
  bool reads_host = false, reads_device = false;
  TrackedTask t() const { return TrackedTask{id, after, host, device, reads_host, reads_device}; }
};

TEST(BlockTracker, AnEvictionHoldsALoadOfTheSameHostBlockUntilItIsReleased) {
  BlockTracker bt(8, 8);
  const Task evict{1, {3}, {0}}, load{2, {3}, {5}}, other{3, {4}, {6}};
  ASSERT_TRUE(bt.try_admit(evict.t(), kToHost));
  EXPECT_FALSE(bt.try_admit(load.t(), kToDevice)) << "same host block, other lane";
  EXPECT_TRUE(bt.try_admit(other.t(), kToDevice)) << "other blocks run beside it";
  bt.release(evict.t(), kToHost);
  EXPECT_TRUE(bt.try_admit(load.t(), kToDevice));
}

TEST(BlockTracker, ASwapLaneKeepsItsOwnOrderButTheStoragePoolDoesNot) {
  BlockTracker bt(8, 8);
  const Task a{1, {1}, {1}}, b{2, {1}, {1}};
  ASSERT_TRUE(bt.try_admit(a.t(), kToHost));
  EXPECT_TRUE(bt.try_admit(b.t(), kToHost)) << "one lane runs its queue in order";
  const Task s1{3, {5}, {}}, s2{4, {5}, {}};
  ASSERT_TRUE(bt.try_admit(s1.t(), kStorage));
  EXPECT_FALSE(bt.try_admit(s2.t(), kStorage)) << "storage workers keep no order of their own";
}

TEST(BlockTracker, AnAfterTaskStillInFlightOnAnotherLaneHoldsTheTask) {
  BlockTracker bt(8, 8);
  const Task first{7, {1}, {1}};
  Task second{8, {2}, {2}};
  second.after = 7;
  ASSERT_TRUE(bt.try_admit(first.t(), kToHost));
  EXPECT_FALSE(bt.try_admit(second.t(), kToDevice));
  bt.release(first.t(), kToHost);
  EXPECT_TRUE(bt.try_admit(second.t(), kToDevice));
}

TEST(BlockTracker, AdmitWaitsForTheReleaseAndIdleSeesEverythingGone) {
  test::Watchdog dog(30);
  BlockTracker bt(8, 8);
  const Task evict{1, {3}, {0}}, load{2, {3}, {5}};
  ASSERT_TRUE(bt.try_admit(evict.t(), kToHost));
  std::atomic<bool> admitted{false};
  std::thread waiter([&] {
    bt.admit(load.t(), kToDevice, 1'000'000);
    admitted.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(admitted.load());
  bt.release(evict.t(), kToHost);
  waiter.join();
  EXPECT_TRUE(admitted.load());
  EXPECT_FALSE(bt.idle());
  bt.release(load.t(), kToDevice);
  EXPECT_TRUE(bt.idle());
  bt.wait_until_idle(1'000'000, {});
}

// A load of a host block was ordered behind the backup STORAGE_WRITE that only
// reads the same block (read/read counted as a conflict), so an eviction that carries keys held
// every later load of its blocks for as long as the store took.
TEST(BlockTracker, TwoTasksThatOnlyReadABlockRunTogether) {
  BlockTracker bt(8, 8);
  Task backup{1, {3}, {}};  // STORAGE_WRITE of host block 3: reads it
  backup.reads_host = true;
  Task load{2, {3}, {5}};  // SWAP_TO_DEVICE: reads host 3, writes device 5
  load.reads_host = true;
  ASSERT_TRUE(bt.try_admit(backup.t(), kStorage));
  EXPECT_TRUE(bt.try_admit(load.t(), kToDevice)) << "read/read is not a conflict";
}

TEST(BlockTracker, AWriteStillWaitsForReadersAndAReadForWriters) {
  BlockTracker bt(8, 8);
  const Task evict{1, {3}, {0}, 0, false, true};  // SWAP_TO_HOST: reads device 0, writes host 3
  Task backup{2, {3}, {}};                         // its backup reads host 3: after the eviction wrote it
  backup.reads_host = true;
  ASSERT_TRUE(bt.try_admit(evict.t(), kToHost));
  EXPECT_FALSE(bt.try_admit(backup.t(), kStorage)) << "a read waits for the write before it";
  bt.release(evict.t(), kToHost);
  ASSERT_TRUE(bt.try_admit(backup.t(), kStorage));
  const Task overwrite{3, {3}, {1}, 0, false, true};  // a new eviction into host 3
  EXPECT_FALSE(bt.try_admit(overwrite.t(), kToHost)) << "a write waits for the read before it";
  bt.release(backup.t(), kStorage);
  EXPECT_TRUE(bt.try_admit(overwrite.t(), kToHost));
}

}  // namespace
}  // namespace kvtd::daemon
