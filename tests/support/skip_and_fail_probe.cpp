// A binary with one skipped and one failing test: ctest_reports_a_failure_beside_a_skip checks
// that it exits 1, never the skip code (see skip_aware_main.cpp).
#include <gtest/gtest.h>

TEST(SkipAndFailProbe, Skipped) { GTEST_SKIP() << "skipped on purpose"; }
TEST(SkipAndFailProbe, Fails) { EXPECT_EQ(1, 2) << "fails on purpose"; }
