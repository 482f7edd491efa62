#include "kvtd/ipc/wait.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "kvtd/ipc/clock.h"

namespace kvtd::ipc {
namespace {

TEST(WaitOnWord, TimesOutAtItsDeadline) {
  std::atomic<std::uint32_t> word{0}, waiters{0};
  const auto t0 = monotonic_now_ns();
  EXPECT_EQ(wait_on_word(word, 0, t0 + 30'000'000, &waiters), WaitResult::kTimedOut);
  EXPECT_GE(monotonic_now_ns() - t0, 30'000'000);
  EXPECT_EQ(waiters.load(), 0u);
}

TEST(WaitOnWord, ReturnsAtOnceWhenTheWordAlreadyChanged) {
  std::atomic<std::uint32_t> word{5};
  EXPECT_EQ(wait_on_word(word, 4, monotonic_now_ns() + 1'000'000'000, nullptr), WaitResult::kChanged);
}

TEST(WaitOnWord, SleeperIsWokenByBump) {
  std::atomic<std::uint32_t> word{0}, waiters{0};
  std::thread t([&] {
    while (waiters.load() == 0) std::this_thread::yield();  // the waiter is asleep in the kernel
    bump_and_wake(word, &waiters);
  });
  EXPECT_EQ(wait_on_word(word, 0, monotonic_now_ns() + 10'000'000'000, &waiters, 0), WaitResult::kChanged);
  t.join();
}

// RankEndpoint::expect_task_soon wakes its dispatcher asleep on the engine's publish word; the
// word is the engine's, so the wake must leave it as it is. The waker repeats its wake until the
// sleeper is back: a wake that lands between the sleeper counting itself in `waiters` and
// entering FUTEX_WAIT is lost (the word did not change, so the kernel cannot tell), which is
// why the header calls it a hint. A single wake made this test fail once in CI (10 s asleep).
TEST(WaitOnWord, WakeSleepersWakesWithoutChangingTheWord) {
  std::atomic<std::uint32_t> word{7}, waiters{0};
  std::atomic<bool> back{false};
  std::thread t([&] {
    while (!back.load()) {
      if (waiters.load() != 0) wake_sleepers(word, &waiters);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  const auto t0 = monotonic_now_ns();
  EXPECT_EQ(wait_on_word(word, 7, t0 + 10'000'000'000, &waiters, 0), WaitResult::kChanged);
  back = true;
  EXPECT_LT(monotonic_now_ns() - t0, 5'000'000'000) << "the sleeper was not woken";
  EXPECT_EQ(word.load(), 7u);
  t.join();
}

}  // namespace
}  // namespace kvtd::ipc
