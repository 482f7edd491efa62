// The engine's completion merger (client/engine/src/completion_merger.h) in-process: how the
// ranks' reports of a task become the one result the engine hands out.
#include "completion_merger.h"

#include <gtest/gtest.h>

namespace kvtd::engine {
namespace {

using proto::TaskStatus;

constexpr std::uint32_t kTwoRanks = 0b11, kThreeRanks = 0b111;

TEST(CompletionMerger, ATaskIsDoneOnlyWhenEveryExpectedRankReportedAndBlocksAreTheMin) {
  CompletionMerger m;
  m.expect(7, 70, kTwoRanks, 100);
  EXPECT_FALSE(m.report(7, 1, TaskStatus::kOk, 4, "", 0, 200));
  EXPECT_FALSE(m.take(7).has_value()) << "rank 0 has not reported";
  EXPECT_TRUE(m.report(7, 0, TaskStatus::kOk, 3, "", 0, 300));
  auto r = m.take(7);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->ok());
  EXPECT_EQ(r->blocks_done, 3u);
  EXPECT_EQ(r->submit_ns, 100);
  EXPECT_EQ(r->complete_ns, 300);
  EXPECT_FALSE(m.take(7).has_value()) << "a result is handed out once";
  EXPECT_FALSE(m.pending(7));
}

TEST(CompletionMerger, TheStatusIsTheLowestFailingRanksWhateverTheOrder) {
  CompletionMerger m;
  m.expect(1, 0, kThreeRanks, 0);
  m.report(1, 2, TaskStatus::kDeviceError, 5, "rank 2 broke", 0, 1);
  m.report(1, 1, TaskStatus::kIdOutOfRange, 5, "rank 1 refused", 0, 2);
  m.report(1, 0, TaskStatus::kOk, 5, "", 0, 3);
  auto r = m.take(1);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, TaskStatus::kIdOutOfRange);
  ASSERT_EQ(r->failures.size(), 2u);
  EXPECT_EQ(r->failures[0].rank, 1u);
  EXPECT_EQ(r->blocks_done, 0u) << "a failed task moved nothing usable";
}

TEST(CompletionMerger, ACancelledTaskKeepsHowFarEveryRankGot) {
  CompletionMerger m;
  m.expect(2, 0, kTwoRanks, 0);
  m.report(2, 0, TaskStatus::kCancelled, 6, "cancelled", 0, 1);
  m.report(2, 1, TaskStatus::kOk, 8, "", 0, 2);
  auto r = m.take(2);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status, TaskStatus::kCancelled);
  EXPECT_EQ(r->blocks_done, 6u);
}

TEST(CompletionMerger, LateDuplicateAndForeignReportsChangeNothing) {
  CompletionMerger m;
  m.expect(3, 0, 0b01, 0);  // rank 0 only
  EXPECT_FALSE(m.report(3, 1, TaskStatus::kDeviceError, 0, "not expected", 0, 1));
  EXPECT_FALSE(m.report(3, 40, TaskStatus::kDeviceError, 0, "no such rank", 0, 1));
  EXPECT_TRUE(m.report(3, 0, TaskStatus::kOk, 2, "", 0, 2));
  EXPECT_FALSE(m.report(3, 0, TaskStatus::kDeviceError, 0, "late", 0, 3));
  auto r = m.take(3);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->ok());
  EXPECT_EQ(m.fail_rank(0, TaskStatus::kRankDead, "gone", 4), 0u);
}

TEST(CompletionMerger, ADeadRankFailsOnlyTheTasksStillWaitingForIt) {
  CompletionMerger m;
  m.expect(4, 0, kTwoRanks, 0);
  m.expect(5, 1, kTwoRanks, 0);
  m.report(5, 1, TaskStatus::kOk, 1, "", 0, 1);  // rank 1 finished task 5 before it died
  m.report(4, 0, TaskStatus::kOk, 1, "", 0, 1);
  EXPECT_EQ(m.fail_rank(1, TaskStatus::kRankDead, "rank 1 exited", 2), 1u);
  auto four = m.take(4);
  ASSERT_TRUE(four.has_value());
  EXPECT_EQ(four->status, TaskStatus::kRankDead);
  EXPECT_EQ(four->failures[0].message, "rank 1 exited");
  EXPECT_TRUE(m.pending(5)) << "task 5 still waits for rank 0";
  EXPECT_EQ(m.seq_of(5), std::optional<std::uint64_t>{1});
  EXPECT_EQ(m.reported(5), 0b10u);
}

TEST(CompletionMerger, UncollectedResultsBeyondTheLimitAreDroppedOldestFirst) {
  CompletionMerger m(2);
  for (std::uint64_t id = 1; id <= 3; ++id) {
    m.expect(id, id, 0b1, 0);
    m.report(id, 0, TaskStatus::kOk, 1, "", 0, 1);
  }
  EXPECT_EQ(m.peek(1), nullptr);
  EXPECT_NE(m.peek(2), nullptr);
  EXPECT_NE(m.peek(3), nullptr);
}

}  // namespace
}  // namespace kvtd::engine
