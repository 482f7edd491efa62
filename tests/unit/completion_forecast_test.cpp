// The completion forecast (client/engine/src/completion_forecast.h): when a swap should report,
// from the ranks' own timing of the last swap of its direction, and the wait planned around it.
#include "completion_forecast.h"

#include <gtest/gtest.h>

namespace kvtd::engine {
namespace {

using proto::TaskKind;

TEST(CompletionForecast, ScalesTheLastSwapOfItsDirectionByBlocks) {
  CompletionForecast f;
  EXPECT_FALSE(f.end_of(TaskKind::kSwapToHost, 16, 0).has_value()) << "nothing learned yet";
  // Submitted at 1 ms, begun 10 us later, reported after 800 us of execution.
  f.learn(TaskKind::kSwapToHost, 16, 1'000'000, 1'010'000, 1'810'000);
  EXPECT_EQ(f.end_of(TaskKind::kSwapToHost, 16, 5'000'000), 5'000'000 + 10'000 + 800'000);
  EXPECT_EQ(f.end_of(TaskKind::kSwapToHost, 32, 5'000'000), 5'000'000 + 10'000 + 1'600'000);
  EXPECT_EQ(f.end_of(TaskKind::kSwapToHost, 1, 5'000'000), 5'000'000 + 10'000 + 50'000);
  EXPECT_FALSE(f.end_of(TaskKind::kSwapToDevice, 16, 0).has_value()) << "the other direction has its own";
  EXPECT_FALSE(f.end_of(TaskKind::kStorageRead, 16, 0).has_value()) << "storage waits on disks, not a rate";
  EXPECT_FALSE(f.end_of(TaskKind::kSwapToHost, 0, 0).has_value());
  EXPECT_EQ(CompletionForecast::direction(TaskKind::kSwapToHost), 0);
  EXPECT_EQ(CompletionForecast::direction(TaskKind::kSwapToDevice), 1);
  EXPECT_EQ(CompletionForecast::direction(TaskKind::kPrefetch), -1);
  // The latest swap of a direction replaces the one before.
  f.learn(TaskKind::kSwapToHost, 8, 0, 20'000, 220'000);
  EXPECT_EQ(f.end_of(TaskKind::kSwapToHost, 16, 0), 20'000 + 400'000);
}

TEST(CompletionForecast, StampsThatSayNothingAreNotLearned) {
  CompletionForecast f;
  f.learn(TaskKind::kSwapToDevice, 4, 1'000, 0, 0);                  // no rank stamped its report
  f.learn(TaskKind::kSwapToDevice, 4, 1'000, 5'000, 4'000);          // ended before it began
  f.learn(TaskKind::kSwapToDevice, 4, 10'000, 5'000, 9'000);         // began before it was submitted
  f.learn(TaskKind::kSwapToDevice, 4, 0, 1'000, 2'000'001'000);      // ran 2 s: a stall, not a rate
  f.learn(TaskKind::kSwapToDevice, 0, 0, 1'000, 2'000);              // named no block
  f.learn(TaskKind::kStorageWrite, 4, 0, 1'000, 2'000);              // not a swap
  EXPECT_FALSE(f.end_of(TaskKind::kSwapToDevice, 4, 0).has_value());
  EXPECT_FALSE(f.end_of(TaskKind::kStorageWrite, 4, 0).has_value());
  f.learn(TaskKind::kSwapToDevice, 1, 0, 1'000, 2'000'000);          // learned; 64 times as many blocks
  EXPECT_FALSE(f.end_of(TaskKind::kSwapToDevice, 1024, 0).has_value()) << "a forecast past 1 s is none";
}

TEST(CompletionForecast, TheWaitPollsAnEighthOfTheTaskAroundItsForecastWithinBounds) {
  const CompletionWait w = plan_completion_wait(1'000'000, 1'000'000 + 800'000);  // 800 us: +-50 us
  EXPECT_EQ(w.sleep_until_ns, 1'800'000 - 50'000);
  EXPECT_EQ(w.poll_until_ns, 1'800'000 + 50'000);
  const CompletionWait small = plan_completion_wait(0, 100'000);  // at least +-20 us
  EXPECT_EQ(small.sleep_until_ns, 80'000);
  EXPECT_EQ(small.poll_until_ns, 120'000);
  const CompletionWait large = plan_completion_wait(0, 30'000'000);  // at most +-200 us
  EXPECT_EQ(large.sleep_until_ns, 29'800'000);
  EXPECT_EQ(large.poll_until_ns, 30'200'000);
}

TEST(CompletionForecast, WhereAWaiterTookTheResultIsPlacedAgainstTheWindow) {
  const CompletionWait w{1'000'000, 1'100'000};
  struct Row {
    std::int64_t taken_ns;
    WaitLanding landing;
  } rows[] = {
      {0, WaitLanding::kBeforeWindow},          // the report came while the waiter slept
      {999'999, WaitLanding::kBeforeWindow},
      {1'000'000, WaitLanding::kInWindow},      // the window's bounds belong to it
      {1'050'000, WaitLanding::kInWindow},
      {1'100'000, WaitLanding::kInWindow},
      {1'100'001, WaitLanding::kAfterWindow},   // it had gone back to sleep
      {9'000'000, WaitLanding::kAfterWindow},
  };
  for (const Row& r : rows) EXPECT_EQ(landing_of(w, r.taken_ns), r.landing) << "taken at " << r.taken_ns;
}

}  // namespace
}  // namespace kvtd::engine
