#include "kvtd/kernels/copy_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

namespace kvtd::kernels {
namespace {

const std::vector<std::uint64_t> kBytes{256, 256};

std::vector<std::pair<int, int>> covered_pairs(const CopyPlan& p) {
  std::vector<std::pair<int, int>> out;
  for (const auto& r : p.runs)
    for (int i = 0; i < r.count; ++i) out.emplace_back(r.src + i, r.dst + i);
  for (std::size_t i = 0; i < p.single_src.size(); ++i) out.emplace_back(p.single_src[i], p.single_dst[i]);
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CopyPlan, EmptyTaskIsAnEmptyPlan) {
  auto p = plan_copy({}, {}, 10, 10, kBytes);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->runs.empty());
  EXPECT_TRUE(p->single_src.empty());
  EXPECT_EQ(p->num_blocks, 0);
}

TEST(CopyPlan, MergesRunsWhereBothSidesAreConsecutive) {
  std::vector<std::int32_t> src{4, 5, 6, 9, 10, 2, 7};
  std::vector<std::int32_t> dst{0, 1, 2, 3, 8, 5, 6};
  auto p = plan_copy(src, dst, 16, 16, kBytes);
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->runs.size(), 1u);  // 4,5,6 -> 0,1,2 ; 9->3 and 10->8 break on dst; 2->5 and 7->6 break on src
  EXPECT_EQ(p->runs[0].src, 4);
  EXPECT_EQ(p->runs[0].dst, 0);
  EXPECT_EQ(p->runs[0].count, 3);
  EXPECT_EQ(p->single_src, (std::vector<std::int32_t>{9, 10, 2, 7}));
  EXPECT_EQ(p->single_dst, (std::vector<std::int32_t>{3, 8, 5, 6}));
  EXPECT_EQ(p->num_blocks, 7);
}

TEST(CopyPlan, SinglesOnlyCutsRunsIntoTheSamePairs) {
  std::vector<std::int32_t> src{4, 5, 6, 9, 10, 2, 7};
  std::vector<std::int32_t> dst{0, 1, 2, 3, 8, 5, 6};
  auto p = plan_copy(src, dst, 16, 16, kBytes);
  ASSERT_TRUE(p.ok());
  const CopyPlan s = singles_only(*p);
  EXPECT_TRUE(s.runs.empty());
  EXPECT_EQ(s.num_blocks, 7);
  EXPECT_EQ(s.single_src, (std::vector<std::int32_t>{4, 5, 6, 9, 10, 2, 7}));  // the run's pairs first
  EXPECT_EQ(s.single_dst, (std::vector<std::int32_t>{0, 1, 2, 3, 8, 5, 6}));
  EXPECT_EQ(covered_pairs(s), covered_pairs(*p));
  EXPECT_EQ(singles_only(CopyPlan{}).num_blocks, 0);
}

TEST(CopyPlan, RejectsEachInvalidInputClassWithItsCode) {
  std::vector<std::int32_t> ok_src{1, 2, 3}, ok_dst{4, 5, 6};
  auto code = [&](std::vector<std::int32_t> s, std::vector<std::int32_t> d, std::int64_t sb = 8, std::int64_t db = 8,
                  std::vector<std::uint64_t> bytes = {256}) {
    auto p = plan_copy(s, d, sb, db, bytes);
    EXPECT_FALSE(p.ok());
    if (!p.ok()) {
      EXPECT_FALSE(p.error().message.empty());
      return p.error().code;
    }
    return PlanErrc::kSizeOverflow;
  };
  EXPECT_EQ(code({1, 2}, {1}), PlanErrc::kLengthMismatch);
  EXPECT_EQ(code({-1, 2, 3}, ok_dst), PlanErrc::kSourceOutOfRange);
  EXPECT_EQ(code({1, 8, 3}, ok_dst), PlanErrc::kSourceOutOfRange);
  EXPECT_EQ(code(ok_src, {4, -5, 6}), PlanErrc::kDestinationOutOfRange);
  EXPECT_EQ(code(ok_src, {4, 5, 8}), PlanErrc::kDestinationOutOfRange);
  EXPECT_EQ(code(ok_src, {4, 5, 4}), PlanErrc::kDuplicateDestination);
  EXPECT_EQ(code(ok_src, ok_dst, 8, 8, {std::uint64_t{1} << 62}), PlanErrc::kSizeOverflow);
  EXPECT_EQ(code(ok_src, ok_dst, -1, 8), PlanErrc::kSizeOverflow);
}

TEST(CopyPlan, ErrorMessagesNameThePair) {
  std::vector<std::int32_t> s{0, 1, 99}, d{0, 1, 2};
  auto p = plan_copy(s, d, 10, 10, kBytes);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message.find("pair 2"), std::string::npos) << p.error().message;
  EXPECT_NE(p.error().message.find("99"), std::string::npos) << p.error().message;
}

// A rejected task must not leave destination bits behind for the next plan on this thread.
TEST(CopyPlan, DuplicateDestinationErrorLeavesNoStaleBits) {
  std::vector<std::int32_t> s{0, 1, 2}, d{7, 3, 7};
  ASSERT_FALSE(plan_copy(s, d, 10, 10, kBytes).ok());
  std::vector<std::int32_t> s2{0, 1}, d2{3, 7};
  EXPECT_TRUE(plan_copy(s2, d2, 10, 10, kBytes).ok());
  std::vector<std::int32_t> s3{0, 99}, d3{5, 6};  // out of range after one dst bit was set
  ASSERT_FALSE(plan_copy(s3, d3, 10, 10, kBytes).ok());
  std::vector<std::int32_t> s4{4}, d4{5};
  EXPECT_TRUE(plan_copy(s4, d4, 10, 10, kBytes).ok());
}

TEST(CopyPlanProperty, RandomSetsAreCoveredExactlyWithMaximalRuns) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int src_blocks = 1 + static_cast<int>(rng() % 300);
    const int dst_blocks = 1 + static_cast<int>(rng() % 300);
    const int n = static_cast<int>(rng() % static_cast<unsigned>(std::min(src_blocks, dst_blocks) + 1));
    std::vector<std::int32_t> dsts(static_cast<std::size_t>(dst_blocks));
    std::iota(dsts.begin(), dsts.end(), 0);
    std::shuffle(dsts.begin(), dsts.end(), rng);
    std::vector<std::int32_t> src, dst;
    // Build with a bias towards runs: sometimes continue the previous pair on both sides.
    std::set<int> used_dst;
    for (int i = 0; i < n; ++i) {
      if (!src.empty() && rng() % 2 == 0 && src.back() + 1 < src_blocks && dst.back() + 1 < dst_blocks &&
          !used_dst.count(dst.back() + 1)) {
        src.push_back(src.back() + 1);
        dst.push_back(dst.back() + 1);
      } else {
        int d = -1;
        for (int t : dsts)
          if (!used_dst.count(t)) {
            d = t;
            break;
          }
        if (d < 0) break;
        src.push_back(static_cast<std::int32_t>(rng() % static_cast<unsigned>(src_blocks)));
        dst.push_back(d);
      }
      used_dst.insert(dst.back());
    }
    auto p = plan_copy(src, dst, src_blocks, dst_blocks, kBytes);
    ASSERT_TRUE(p.ok()) << p.error().message;
    std::vector<std::pair<int, int>> want;
    for (std::size_t i = 0; i < src.size(); ++i) want.emplace_back(src[i], dst[i]);
    std::sort(want.begin(), want.end());
    ASSERT_EQ(covered_pairs(*p), want);
    std::size_t breaks = src.empty() ? 0 : 1;
    for (std::size_t i = 1; i < src.size(); ++i)
      if (!(src[i] == src[i - 1] + 1 && dst[i] == dst[i - 1] + 1)) ++breaks;
    ASSERT_EQ(p->runs.size() + p->single_src.size(), breaks) << "runs are not maximal";
    for (const auto& r : p->runs) ASSERT_GE(r.count, 2);
    ASSERT_EQ(p->num_blocks, static_cast<std::int64_t>(src.size()));
  }
}

TEST(CopyPlanProperty, RandomCorruptionsAreAllRejected) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 1000; ++trial) {
    std::vector<std::int32_t> src(16), dst(16);
    std::iota(src.begin(), src.end(), 0);
    std::iota(dst.begin(), dst.end(), 0);
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
    const std::size_t i = rng() % 16;
    PlanErrc want{};
    switch (trial % 5) {
      case 0: src[i] = -1 - static_cast<int>(rng() % 5); want = PlanErrc::kSourceOutOfRange; break;
      case 1: src[i] = 64 + static_cast<int>(rng() % 5); want = PlanErrc::kSourceOutOfRange; break;
      case 2: dst[i] = 64 + static_cast<int>(rng() % 5); want = PlanErrc::kDestinationOutOfRange; break;
      case 3: dst[i] = dst[(i + 1) % 16]; want = PlanErrc::kDuplicateDestination; break;
      case 4: dst.pop_back(); want = PlanErrc::kLengthMismatch; break;
    }
    auto p = plan_copy(src, dst, 64, 64, kBytes);
    ASSERT_FALSE(p.ok());
    ASSERT_EQ(p.error().code, want) << p.error().message;
  }
}

}  // namespace
}  // namespace kvtd::kernels
