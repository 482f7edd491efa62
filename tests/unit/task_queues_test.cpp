// The storage executor's queues and task sets (daemon/storage/task_queues.h) in-process: loads go
// before writes and writes take at most their workers; a CANCEL is answered truthfully against the
// last step; a backup past the queue bound is refused with the flag named; a revoked epoch's
// queued work is handed back.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "kvtd/ipc/clock.h"
#include "task_queues.h"
#include "test_support.h"

namespace kvtd::daemon {
namespace {

StorageWork work(std::uint64_t id, proto::TaskKind kind) {
  StorageWork w;
  w.header.task_id = id;
  w.header.kind = static_cast<std::uint16_t>(kind);
  w.header.submit_ns = ipc::monotonic_now_ns();
  return w;
}

Prepared prepared(std::uint64_t id, proto::TaskKind kind, std::uint64_t backup_bytes = 0) {
  Prepared p;
  p.work = work(id, kind);
  p.backup_bytes = backup_bytes;
  return p;
}

TaskQueues::Limits limits(std::uint32_t write_workers = 1) {
  TaskQueues::Limits l;
  l.write_workers = write_workers;
  l.backup_queue_bytes = 1 << 20;
  l.backup_max_age_ns = 10'000'000'000;
  return l;
}

TEST(TaskQueues, LoadsGoFirstAndWritesTakeAtMostTheirWorkers) {
  test::Watchdog dog(30);
  TaskQueues q(limits(1));
  q.to_objects(prepared(1, proto::TaskKind::kStorageWrite));
  q.to_objects(prepared(2, proto::TaskKind::kStorageWrite));
  q.to_objects(prepared(3, proto::TaskKind::kStorageRead));
  auto first = q.next_to_move();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->p.work.header.task_id, 3u) << "the load goes before the writes queued ahead of it";
  auto second = q.next_to_move();
  ASSERT_TRUE(second.has_value());
  EXPECT_TRUE(second->write);
  EXPECT_EQ(second->p.work.header.task_id, 1u);
  // The one write worker is busy: the next write waits until it is free.
  std::atomic<bool> taken{false};
  std::thread waiter([&] {
    auto third = q.next_to_move();
    EXPECT_TRUE(third.has_value() && third->p.work.header.task_id == 2u);
    taken = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(taken.load()) << "a second write started while the only write worker was busy";
  q.moved(*second);
  waiter.join();
  EXPECT_TRUE(taken.load());
  q.close();
  EXPECT_FALSE(q.next_to_agree().has_value());
  q.agreement_ended();
  EXPECT_FALSE(q.next_to_move().has_value()) << "closed and empty: the workers stop";
}

TEST(TaskQueues, ACancelIsAnsweredTruthfullyAgainstTheLastStep) {
  TaskQueues q(limits());
  auto a = work(1, proto::TaskKind::kStorageWrite), b = work(2, proto::TaskKind::kStorageWrite);
  ASSERT_EQ(q.admit(a, std::nullopt, ipc::monotonic_now_ns()), "");
  ASSERT_EQ(q.admit(b, std::nullopt, ipc::monotonic_now_ns()), "");
  EXPECT_TRUE(q.cancel(1)) << "not past its last step: it will stop";
  EXPECT_FALSE(q.may_continue(1, false));
  EXPECT_TRUE(q.may_continue(2, /*last_step=*/true));
  EXPECT_FALSE(q.cancel(2)) << "past its last check: saying it stops would be a lie";
  EXPECT_FALSE(q.cancel(3)) << "not live here";
  q.forget(1);
  EXPECT_FALSE(q.is_cancelled(1));
}

TEST(TaskQueues, ABackupPastTheQueueBoundIsRefusedNamingTheFlag) {
  TaskQueues q(limits());
  q.to_objects(prepared(1, proto::TaskKind::kStorageWrite, 1 << 20));  // the whole bound waits
  auto backup = work(2, proto::TaskKind::kStorageWrite);
  const auto why = q.admit(backup, 4096, ipc::monotonic_now_ns());
  EXPECT_NE(why.find("--storage-backup-queue-mib 1"), std::string::npos) << why;
  EXPECT_EQ(backup.header.task_id, 2u) << "a refused task is left to the caller";
  auto explicit_write = work(3, proto::TaskKind::kStorageWrite);
  EXPECT_EQ(q.admit(explicit_write, std::nullopt, ipc::monotonic_now_ns()), "") << "only backups are bounded";
  // A revoked epoch: everything queued comes back and the bound is free again.
  const auto dropped = q.drop_queued();
  EXPECT_EQ(dropped.size(), 2u);
  auto again = work(4, proto::TaskKind::kStorageWrite);
  EXPECT_EQ(q.admit(again, 4096, ipc::monotonic_now_ns()), "");
}

}  // namespace
}  // namespace kvtd::daemon
