// The file store's I/O threads (storage/src/io_pool.h): every index runs exactly once per batch,
// several callers at once each get all their calls, help arrives without a thread per batch, and
// a batch finishes even when every helper is busy with another one.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "io_pool.h"

namespace kvtd::storage::detail {
namespace {

TEST(IoPoolTest, EveryIndexRunsOnceAndTheBatchIsDoneOnReturn) {
  IoPool pool(4);
  for (std::size_t n : {0u, 1u, 3u, 4u, 257u}) {
    std::vector<std::atomic<int>> runs(n);
    pool.run(n, 4, [&](std::size_t i) { runs[i].fetch_add(1); });
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(runs[i].load(), 1) << "n " << n << " index " << i;
  }
}

TEST(IoPoolTest, HelpersAreTheSameThreadsFromBatchToBatch) {
  IoPool pool(2);
  std::mutex mu;
  std::set<std::thread::id> seen;
  for (int batch = 0; batch < 200; ++batch) {
    pool.run(8, 2, [&](std::size_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      std::lock_guard g(mu);
      seen.insert(std::this_thread::get_id());
    });
  }
  // The caller and the one helper; a thread started per batch would show up to 201 ids.
  EXPECT_LE(seen.size(), 2u);
  EXPECT_TRUE(seen.count(std::this_thread::get_id()));
}

TEST(IoPoolTest, ABatchAskingForOneThreadRunsOnTheCallerAlone) {
  IoPool pool(4);
  std::atomic<int> elsewhere{0};
  const auto me = std::this_thread::get_id();
  pool.run(64, 1, [&](std::size_t) { elsewhere += std::this_thread::get_id() != me; });
  EXPECT_EQ(elsewhere.load(), 0);
}

TEST(IoPoolTest, CallersAtOnceEachGetAllTheirCallsEvenWithEveryHelperBusy) {
  IoPool pool(2);  // one helper for three callers
  std::atomic<bool> release{false};
  std::atomic<int> blocked_started{0};
  std::thread blocker([&] {
    // Holds the helper (or itself) in a call until released: the others must not wait for it.
    pool.run(2, 2, [&](std::size_t) {
      blocked_started.fetch_add(1);
      while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
  });
  while (blocked_started.load() < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::vector<std::thread> callers;
  std::vector<std::atomic<int>> sums(2);
  for (int c = 0; c < 2; ++c)
    callers.emplace_back([&, c] { pool.run(100, 2, [&](std::size_t i) { sums[c].fetch_add(static_cast<int>(i)); }); });
  for (auto& t : callers) t.join();  // done while the blocker still holds its calls
  EXPECT_EQ(sums[0].load(), 4950);
  EXPECT_EQ(sums[1].load(), 4950);
  release = true;
  blocker.join();
}

}  // namespace
}  // namespace kvtd::storage::detail
