// The file store's O_DIRECT load path (--storage-io direct) on the real file
// system: every load interface returns verified bytes, and corrupt, truncated, padded and
// swapped-name objects are misses that never reach the caller. Skipped where the test's temporary
// directory refuses O_DIRECT (the refusal itself is tested through the FileSystem seam: tmpfs
// takes O_DIRECT since Linux 6.6, so it cannot stand for a refusing file system).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "kvtd/storage/file_store.h"
#include "forwarding_file_system.h"
#include "kvtd/storage/object_format.h"

namespace kvtd::storage {
namespace {

namespace fs = std::filesystem;
constexpr std::uint64_t kObject = 3 * 4096 + 1000;  // header + payload cross several aligned blocks

std::vector<std::byte> pattern(std::uint32_t seed) {
  std::vector<std::byte> v(kObject);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

class DirectReadsTest : public ::testing::Test {
 protected:
  std::string root_ = (fs::path(::testing::TempDir()) /
                       fmt::format("kvtd_direct_{}_{}", ::getpid(),
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name()))
                          .string();
  std::unique_ptr<ObjectStore> buffered_, direct_;

  void SetUp() override {
    fs::remove_all(root_);
    FileStoreOptions o;
    o.store = StoreOptions{"m", 0x77, kObject};
    o.root = root_;
    auto b = open_file_store(o);
    ASSERT_TRUE(b.ok()) << b.error().message;
    buffered_ = std::move(b).value();
    o.direct_reads = true;
    auto d = open_file_store(o);
    if (!d.ok() && d.error().message.find("does not support O_DIRECT") != std::string::npos)
      GTEST_SKIP() << d.error().message;
    ASSERT_TRUE(d.ok()) << d.error().message;
    direct_ = std::move(d).value();
  }
  void TearDown() override { fs::remove_all(root_); }

  void put(const std::string& key, const std::vector<std::byte>& bytes) {
    const std::string keys[1] = {key};
    const std::byte* srcs[1] = {bytes.data()};
    auto r = write_from(*buffered_, keys, srcs, kObject);
    ASSERT_TRUE(r.ok() && (*r)[0] == ObjectResult::kOk);
  }
  fs::path file_of(const std::string& key) const {
    for (const auto& e : fs::recursive_directory_iterator(root_))
      if (e.path().filename() == key + ".kvo") return e.path();
    return {};
  }
};

TEST_F(DirectReadsTest, EveryReadShapeReturnsTheVerifiedBytes) {
  std::vector<std::string> keys;
  std::vector<std::vector<std::byte>> want;
  for (std::uint32_t i = 0; i < 40; ++i) {  // more than one window of reads in flight
    keys.push_back(fmt::format("k{}", i));
    want.push_back(pattern(i));
    put(keys.back(), want.back());
  }
  std::vector<std::vector<std::byte>> out(keys.size(), std::vector<std::byte>(kObject));
  std::vector<std::byte*> dsts;
  for (auto& o : out) dsts.push_back(o.data());
  auto got = read_to(*direct_, keys, dsts, kObject);
  ASSERT_TRUE(got.ok()) << got.error().message;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ((*got)[i], ObjectResult::kOk);
    EXPECT_EQ(out[i], want[i]) << keys[i];
  }
  // Into three pieces of a destination, as a layer-first block's tensors are, verified bytes or not.
  std::vector<std::byte> a(1000), b(kObject - 3000), c(2000);
  const std::string one[1] = {"k7"};
  for (bool unverified_ok : {false, true}) {
    ReadInto into;
    into.unverified_bytes_ok = unverified_ok;
    into.pieces = [&](std::size_t) { return Pieces{std::span(a), std::span(b), std::span(c)}; };
    std::size_t verified = 0;
    into.on_verified = [&](std::size_t) { ++verified; };
    auto p = direct_->read(one, into);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ((*p)[0], ObjectResult::kOk);
    EXPECT_EQ(verified, 1u);
    std::vector<std::byte> joined(a);
    joined.insert(joined.end(), b.begin(), b.end());
    joined.insert(joined.end(), c.begin(), c.end());
    EXPECT_EQ(joined, want[7]);
  }
  EXPECT_EQ(direct_->stats().hits, 42u);
}

TEST_F(DirectReadsTest, CorruptTruncatedPaddedAndSwappedObjectsAreMissesThatNeverReachTheCaller) {
  for (const char* k : {"flip", "short", "long", "x", "y", "ok"}) put(k, pattern(static_cast<std::uint32_t>(k[0])));
  {
    std::fstream io(file_of("flip"), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(static_cast<std::streamoff>(sizeof(ObjectHeader) + 5000));
    io.put('\x01');
  }
  fs::resize_file(file_of("short"), sizeof(ObjectHeader) + kObject - 1);
  std::ofstream(file_of("long"), std::ios::app | std::ios::binary) << "z";
  // Swapped names: each file holds the other key's whole object (its key hash is foreign).
  const fs::path fx = file_of("x"), fy = file_of("y"), tmp = fx.string() + ".swap";
  fs::rename(fx, tmp);
  fs::rename(fy, fx);
  fs::rename(tmp, fy);
  const std::vector<std::string> keys = {"flip", "short", "long", "x", "y", "ok", "absent"};
  const std::vector<std::byte> mine(kObject, std::byte{0x33});
  std::vector<std::vector<std::byte>> out(keys.size(), mine);
  std::vector<std::byte*> dsts;
  for (auto& o : out) dsts.push_back(o.data());
  auto got = read_to(*direct_, keys, dsts, kObject);
  ASSERT_TRUE(got.ok()) << got.error().message;
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ((*got)[i], ObjectResult::kCorrupt) << keys[i];
    EXPECT_EQ(out[i], mine) << "the caller's buffer changed on a failed load of " << keys[i];
  }
  EXPECT_EQ((*got)[5], ObjectResult::kOk);
  EXPECT_EQ(out[5], pattern('o'));
  EXPECT_EQ((*got)[6], ObjectResult::kMissing);
  EXPECT_EQ(direct_->stats().corrupt, 5u);
}

// A file system without a direct path: the seam's default (EOPNOTSUPP), or one whose open with
// O_DIRECT fails with EINVAL, as tmpfs before Linux 6.6 and some overlays do.
class NoDirectFileSystem final : public test::ForwardingFileSystem {
 public:
  explicit NoDirectFileSystem(int per_read_error) : per_read_error_(per_read_error) {}
  int read_direct(std::span<DirectRead> reads) override {
    if (per_read_error_ == 0) return FileSystem::read_direct(reads);
    for (auto& r : reads) r.error = per_read_error_;
    return 0;
  }

 private:
  int per_read_error_;
};

TEST(DirectReadsRefused, AFileSystemThatRefusesODirectIsRefusedAtOpenNamingTheRootAndTheWayOut) {
  for (const int error : {EINVAL, 0}) {
    NoDirectFileSystem nfs(error);
    const std::string root = fmt::format("{}/kvtd_direct_nofs_{}", ::testing::TempDir(), ::getpid());
    FileStoreOptions o;
    o.store = StoreOptions{"m", 0x77, kObject};
    o.root = root;
    o.fs = &nfs;
    o.direct_reads = true;
    auto s = open_file_store(o);
    fs::remove_all(root);
    ASSERT_FALSE(s.ok()) << error;
    EXPECT_NE(s.error().message.find(root), std::string::npos) << s.error().message;
    EXPECT_NE(s.error().message.find("O_DIRECT"), std::string::npos) << s.error().message;
    EXPECT_NE(s.error().message.find("--storage-io buffered"), std::string::npos) << s.error().message;
    if (error == EINVAL) {
      EXPECT_NE(s.error().message.find("does not support O_DIRECT"), std::string::npos) << s.error().message;
    }
  }
}

}  // namespace
}  // namespace kvtd::storage
