// The file store tests' fixture: a temporary root, a file system that fails on demand, and
// helpers to put and get one object (file_store_test, file_store_gc_test).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "forwarding_file_system.h"
#include "kvtd/storage/file_store.h"

namespace kvtd::storage {

namespace fs = std::filesystem;
constexpr std::uint64_t kObject = 4096 + 24;  // not a multiple of anything convenient

// Wraps the real file system and fails chosen operations, like a full or read-only disk.
class FaultyFileSystem final : public test::ForwardingFileSystem {
 public:
  std::atomic<int> write_error{0};   // errno returned by write_file (after writing half)
  std::atomic<int> rename_error{0};
  std::atomic<int> synced_files{0}, synced_dirs{0};

  int write_file(const std::string& p, std::span<const std::span<const std::byte>> parts, bool sync) override {
    if (int e = write_error.load()) {
      // A partial temporary file is left behind, as a real ENOSPC would.
      const std::span<const std::byte> half[1] = {parts[0]};
      real->write_file(p, half, false);
      return e;
    }
    if (sync) ++synced_files;
    return real->write_file(p, parts, sync);
  }
  int write_file_sealed(const std::string& p, std::span<const std::span<const std::byte>> parts, bool sync,
                        const Writing& on_write, const std::function<void()>& seal) override {
    if (write_error.load() != 0) return write_file(p, parts, sync);  // fails as a plain write would
    if (sync) ++synced_files;
    return real->write_file_sealed(p, parts, sync, on_write, seal);
  }
  int rename(const std::string& a, const std::string& b) override {
    if (int e = rename_error.load()) return e;
    return real->rename(a, b);
  }
  int sync_dir(const std::string& p) override {
    ++synced_dirs;
    return real->sync_dir(p);
  }
};

class FileStoreTest : public ::testing::Test {
 protected:
  std::string root_ = (fs::path(::testing::TempDir()) /
                       fmt::format("kvtd_fs_{}_{}", ::getpid(),
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name()))
                          .string();
  void SetUp() override { fs::remove_all(root_); }
  void TearDown() override { fs::remove_all(root_); }

  FileStoreOptions options(std::uint64_t capacity = 0, FileSystem* f = nullptr, std::string model = "llama",
                           std::uint64_t fp = 0xabcdef) {
    FileStoreOptions o;
    o.store = StoreOptions{std::move(model), fp, kObject};
    o.root = root_;
    o.capacity_bytes = capacity;
    o.fs = f;
    return o;
  }
  std::unique_ptr<ObjectStore> open(const FileStoreOptions& o) {
    auto s = open_file_store(o);
    EXPECT_TRUE(s.ok()) << s.error().message;
    return s.ok() ? std::move(s).value() : nullptr;
  }
  static std::vector<std::byte> object(std::uint32_t seed) {
    std::vector<std::byte> v(kObject);
    std::mt19937 rng(seed);
    for (auto& b : v) b = static_cast<std::byte>(rng());
    return v;
  }
  static KeyResult put_one(ObjectStore& s, const std::string& key, const std::vector<std::byte>& bytes,
                           ObjectResult want = ObjectResult::kOk) {
    const std::string keys[1] = {key};
    const std::byte* srcs[1] = {bytes.data()};
    auto r = write_from(s, keys, srcs, kObject);
    EXPECT_TRUE(r.ok()) << r.error().message;
    if (!r.ok()) return {ObjectResult::kFailed, r.error().message};
    EXPECT_EQ((*r)[0], want) << object_result_name((*r)[0].result) << " " << (*r)[0].error;
    return (*r)[0];
  }
  static ObjectResult get_one(ObjectStore& s, const std::string& key, std::vector<std::byte>* out) {
    out->assign(kObject, std::byte{0});
    const std::string keys[1] = {key};
    std::byte* dsts[1] = {out->data()};
    auto r = read_to(s, keys, dsts, kObject);
    EXPECT_TRUE(r.ok());
    return r.ok() ? (*r)[0].result : ObjectResult::kFailed;
  }
  std::vector<std::string> object_files() const {
    std::vector<std::string> out;
    for (auto& e : fs::recursive_directory_iterator(root_))
      if (e.is_regular_file()) out.push_back(e.path().string());
    return out;
  }
};

}  // namespace kvtd::storage
