// How many storage workers a daemon runs (daemon/storage/include/kvtd/daemon/storage_executor.h).
#include <gtest/gtest.h>

#include "kvtd/daemon/storage_executor.h"

namespace kvtd::daemon {
namespace {

TEST(StorageIoThreads, GivenIsKeptAndAutoIsHalfTheCpusFromTwoToEight) {
  config::StorageConfig c;
  c.io_threads = 5;
  EXPECT_EQ(storage_io_threads(c, 1 << 20, 64), 5u);
  c.io_threads = 0;  // not given
  EXPECT_EQ(storage_io_threads(c, 1 << 20, 2), 2u);
  EXPECT_EQ(storage_io_threads(c, 1 << 20, 12), 6u);
  EXPECT_EQ(storage_io_threads(c, 1 << 20, 128), 8u);
}

TEST(StorageIoThreads, AutoNeverLeavesAWorkerWithoutRoomForOneObject) {
  config::StorageConfig c;
  c.staging_mib = 64;
  EXPECT_EQ(storage_io_threads(c, 16ull << 20, 128), 4u);  // 64 MiB holds four 16 MiB objects
  EXPECT_EQ(storage_io_threads(c, 100ull << 20, 128), 1u) << "then the staging check names the problem";
  EXPECT_EQ(staging_problem(c, 16ull << 20), "") << "io_threads 0 is never divided by";
}

}  // namespace
}  // namespace kvtd::daemon
