// storage_fixture.h - the engine side of storage-task tests: ranks are kvtd processes with the
// embedded file store (or Redis, started by the test on loopback); helpers submit storage tasks
// and check every loaded byte against the pattern the blocks were filled with.
#pragma once

#include <filesystem>
#include <fmt/format.h>
#include <string>
#include <vector>

#include "daemon_fixture.h"

namespace kvtd {

namespace fs = std::filesystem;

inline std::vector<std::int32_t> iota_ids(std::int32_t first, std::size_t n) {
  std::vector<std::int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

inline std::vector<std::string> make_keys(const std::string& prefix, std::size_t n) {
  std::vector<std::string> k;
  for (std::size_t i = 0; i < n; ++i) k.push_back(fmt::format("{}{}", prefix, i));
  return k;
}

class StorageTaskTest : public DaemonTest {
 protected:
  std::string store_dir_ = ::testing::TempDir() + "/" + suffix_ + "_store";

  void SetUp() override {
    fs::remove_all(store_dir_);
    extra_args_ = {"--storage-backend", "file", "--storage-path", store_dir_, "--model-id", "m1"};
  }
  void TearDown() override {
    DaemonTest::TearDown();
    if (!HasFailure()) fs::remove_all(store_dir_);
  }

  engine::TaskResult storage(TaskKind kind, const std::vector<std::string>& keys, const std::vector<std::int32_t>& blocks,
                          bool host = false, std::uint32_t min_hits = 0) {
    TaskRequest req;
    req.kind = kind;
    req.keys = keys;
    req.blocks = blocks;
    req.host_blocks = host;
    req.min_hits = min_hits;
    return submit_and_wait(req);
  }

  // A STORAGE_WRITE of host blocks the engine is evicting (written under write_back).
  engine::TaskResult evict_backup(const std::vector<std::string>& keys, const std::vector<std::int32_t>& host_ids) {
    TaskRequest evict;
    evict.kind = TaskKind::kStorageWrite;
    evict.keys = keys;
    evict.blocks = host_ids;
    evict.host_blocks = true;
    evict.evict_backup = true;
    return submit_and_wait(evict);
  }

  // A SWAP_TO_HOST with keys; returns its backup's result (the swap must succeed).
  engine::TaskResult swap_out_with_keys(const std::vector<std::int32_t>& dev, const std::vector<std::int32_t>& host,
                                     const std::vector<std::string>& keys) {
    TaskRequest req;
    req.kind = TaskKind::kSwapToHost;
    req.src = dev;
    req.dst = host;
    req.keys = keys;
    auto id = engine_->submit(req);
    EXPECT_TRUE(id.ok()) << id.error().message;
    if (!id.ok()) return {};
    auto swap = engine_->wait(*id, 60'000'000'000);
    EXPECT_TRUE(swap.ok() && swap->ok());
    auto backup = engine_->wait(*id + 1, 60'000'000'000);
    EXPECT_TRUE(backup.ok()) << backup.error().message;
    return backup.ok() ? *backup : engine::TaskResult{};
  }

  static std::string why(const engine::TaskResult& r) {
    std::string s;
    for (const auto& f : r.failures)
      s += fmt::format("rank {}: {}: {}\n", f.rank, proto::task_status_name(f.status), f.message);
    return s;
  }

  void wipe_device(const std::vector<std::int32_t>& blocks) {
    for_each_tensor([&](std::uint32_t, std::uint32_t, std::uint32_t, std::byte* base, std::uint64_t bb) {
      for (auto b : blocks) std::memset(base + static_cast<std::uint64_t>(b) * bb, 0xee, bb);
    });
  }

  // Device blocks `dst[i]` of every rank hold what block `orig[i]` of rank `as_rank(r)` was filled with.
  template <typename AsRank>
  void expect_device_pattern(const std::vector<std::int32_t>& dst, const std::vector<std::int32_t>& orig, AsRank as_rank,
                             std::size_t count) {
    for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
      for (std::size_t i = 0; i < count; ++i) {
        const auto off = loadgen::check_block(base + static_cast<std::uint64_t>(dst[i]) * bb, bb, as_rank(r), l, k,
                                              static_cast<std::uint32_t>(orig[i]));
        ASSERT_EQ(off, -1) << "rank " << r << " layer " << l << " kind " << k << " block " << dst[i];
      }
    });
  }
  void expect_device_pattern(const std::vector<std::int32_t>& dst, const std::vector<std::int32_t>& orig, std::size_t count) {
    expect_device_pattern(dst, orig, [](std::uint32_t r) { return r; }, count);
  }

  // Stored object files of one rank's slice of key `key`.
  std::vector<fs::path> object_files(const std::string& key, std::uint32_t rank) const {
    std::vector<fs::path> out;
    if (!fs::exists(store_dir_)) return out;
    const std::string needle = key + ".w";
    const std::string tail = fmt::format(".r{}.kvo", rank);
    for (const auto& e : fs::recursive_directory_iterator(store_dir_)) {
      const std::string name = e.path().filename().string();
      if (e.is_regular_file() && name.rfind(needle, 0) == 0 && name.size() > tail.size() &&
          name.compare(name.size() - tail.size(), tail.size(), tail) == 0)
        out.push_back(e.path());
    }
    return out;
  }
};

}  // namespace kvtd
