// The file store's garbage collection on a real directory - other weight
// versions, layouts and (when named) models removed, what is kept still loads, the capacity
// accounting follows (also in a second store sharing the root), bounded by its deadline.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <time.h>

#include <filesystem>
#include <fstream>

#include "file_store_fixture.h"

namespace kvtd::storage {
namespace {

// Names as the daemon makes them: <key>.w<deployment>-<engine weight version>.r<rank>.
std::string name(int i, int weight_version) { return fmt::format("k{}.w0-{}.r0", i, weight_version); }

GcRequest keep_version(int weight_version, std::uint64_t fingerprint = 0xabcdef) {
  GcRequest r;
  r.keep_fingerprints = {fingerprint};
  const std::string tail = fmt::format("-{}.r0", weight_version);
  r.keep_name = [tail](const std::string& n) { return n.size() > tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0; };
  return r;
}

std::int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1'000'000'000LL + ts.tv_nsec;
}

class FileStoreGc : public FileStoreTest {};

TEST_F(FileStoreGc, OldWeightVersionsAndLayoutsGoTheCurrentOnesStillLoad) {
  auto store = open(options());
  auto other_layout = open(options(0, nullptr, "llama", 0x1111));
  auto other_model = open(options(0, nullptr, "mistral"));
  for (int i = 0; i < 4; ++i) {
    put_one(*store, name(i, 1), object(static_cast<std::uint32_t>(i)));
    put_one(*store, name(i, 2), object(static_cast<std::uint32_t>(100 + i)));
  }
  put_one(*other_layout, name(0, 2), object(7));
  put_one(*other_model, name(0, 1), object(8));
  const auto before = store->stats();
  ASSERT_EQ(before.objects_stored, 8u);

  std::vector<std::string> removed;
  auto request = keep_version(2);
  request.on_removed = [&](const std::string& model, const std::string& n) { removed.push_back(model + "/" + n); };
  auto dry = request;
  dry.dry_run = true;
  auto counted = store->collect(dry);
  ASSERT_TRUE(counted.ok()) << counted.error().message;
  EXPECT_EQ(counted->removed, 5u);  // four of version 1, one of the other layout; the other model stays
  EXPECT_EQ(store->stats().objects_stored, 8u) << "a dry run removes nothing";

  auto done = store->collect(request);
  ASSERT_TRUE(done.ok()) << done.error().message;
  EXPECT_TRUE(done->complete);
  EXPECT_EQ(done->examined, 10u);
  EXPECT_EQ(done->removed, 5u);
  EXPECT_EQ(done->kept, 5u);
  EXPECT_EQ(done->failed, 0u);
  EXPECT_EQ(done->removed_bytes, 5 * (before.bytes_stored / 8));
  EXPECT_EQ(removed.size(), 5u);
  const auto after = store->stats();
  EXPECT_EQ(after.objects_stored, 4u);
  EXPECT_EQ(after.bytes_stored, before.bytes_stored / 2);
  std::vector<std::byte> back;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(get_one(*store, name(i, 2), &back), ObjectResult::kOk);
    EXPECT_EQ(back, object(static_cast<std::uint32_t>(100 + i)));
    EXPECT_EQ(get_one(*store, name(i, 1), &back), ObjectResult::kMissing);
  }
  EXPECT_EQ(get_one(*other_model, name(0, 1), &back), ObjectResult::kOk);

  // Naming the models to keep removes every other one.
  request.keep_models = {"llama"};
  auto models = store->collect(request);
  ASSERT_TRUE(models.ok());
  EXPECT_EQ(models->removed, 1u);
  EXPECT_EQ(get_one(*other_model, name(0, 1), &back), ObjectResult::kMissing);
}

// Storage gc removed files whose names merely looked like kvtd's (an old
// version's name, another layout's directory). Only what kvtd wrote under that name goes now: a
// stray file, and a real object copied under another name, stay and are counted foreign.
TEST_F(FileStoreGc, FilesThatOnlyLookLikeObjectsAreNeverRemoved) {
  auto store = open(options());
  put_one(*store, name(0, 1), object(1));
  put_one(*store, name(1, 2), object(2));
  std::string real;
  for (const auto& f : object_files())
    if (f.find(name(0, 1)) != std::string::npos) real = f;
  ASSERT_FALSE(real.empty());
  const fs::path dir = fs::path(real).parent_path();
  const std::string stray = (dir / (name(7, 1) + ".kvo")).string();
  std::ofstream(stray) << "notes the operator keeps here";
  const std::string copied = (dir / (name(8, 1) + ".kvo")).string();
  fs::copy_file(real, copied);  // kvtd's bytes, but written for another name
  auto done = store->collect(keep_version(2));
  ASSERT_TRUE(done.ok()) << done.error().message;
  EXPECT_EQ(done->removed, 1u);  // name(0, 1): kvtd's own
  EXPECT_EQ(done->foreign, 2u);
  EXPECT_TRUE(fs::exists(stray));
  EXPECT_TRUE(fs::exists(copied));
  EXPECT_FALSE(fs::exists(real));
}

TEST_F(FileStoreGc, CapacityAccountingFollowsInEveryStoreSharingTheRoot) {
  // Room for six objects: after the old four go, four new ones fit without evicting anything.
  auto store = open(options(6 * (kObject + 64)));
  for (int i = 0; i < 4; ++i) put_one(*store, name(i, 1), object(static_cast<std::uint32_t>(i)));
  for (int i = 0; i < 2; ++i) put_one(*store, name(i, 2), object(static_cast<std::uint32_t>(10 + i)));
  auto reopened = open(options(6 * (kObject + 64)));  // indexes all six, as a restarted daemon would
  ASSERT_EQ(reopened->stats().objects_stored, 6u);
  ASSERT_TRUE(store->collect(keep_version(2)).ok());
  // The files are gone; the reopened store still counts them until its own collection prunes its index.
  EXPECT_EQ(reopened->stats().objects_stored, 6u);
  auto pruned = reopened->collect(keep_version(2));
  ASSERT_TRUE(pruned.ok());
  EXPECT_EQ(pruned->removed, 0u);  // nothing left to remove, only to forget
  EXPECT_EQ(reopened->stats().objects_stored, 2u);
  for (int i = 2; i < 6; ++i) {
    put_one(*store, name(i, 2), object(static_cast<std::uint32_t>(10 + i)));
    put_one(*reopened, name(i + 10, 2), object(static_cast<std::uint32_t>(30 + i)));
  }
  EXPECT_EQ(store->stats().evictions, 0u) << "the collected bytes must have left the accounting";
  std::vector<std::byte> back;
  EXPECT_EQ(get_one(*store, name(0, 2), &back), ObjectResult::kOk);
}

TEST_F(FileStoreGc, APassedDeadlineStopsTheWalkAndSaysSo) {
  auto store = open(options());
  for (int i = 0; i < 3; ++i) put_one(*store, name(i, 1), object(static_cast<std::uint32_t>(i)));
  auto request = keep_version(2);
  request.deadline_ns = now_ns() - 1;
  auto r = store->collect(request);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->complete);
  EXPECT_EQ(r->removed, 0u);
  request.deadline_ns = 0;
  r = store->collect(request);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->complete);
  EXPECT_EQ(r->removed, 3u);
}

// A session of cache groups stores each group in a namespace of its own: a collection keeps all
// of them (GcRequest::keep_fingerprints), and still removes a layout the deployment left.
TEST_F(FileStoreGc, EveryCacheGroupsNamespaceIsKept) {
  auto group0 = open(options());
  auto group1 = open(options(0, nullptr, "llama", 0x2222));
  auto gone = open(options(0, nullptr, "llama", 0x3333));
  put_one(*group0, name(0, 1), object(1));
  put_one(*group1, name(0, 1), object(2));
  put_one(*gone, name(0, 1), object(3));
  auto request = keep_version(1);
  request.keep_fingerprints.push_back(0x2222);
  auto done = group0->collect(request);
  ASSERT_TRUE(done.ok()) << done.error().message;
  EXPECT_EQ(done->removed, 1u);  // the layout no group has
  const std::string key = name(0, 1);
  EXPECT_EQ(*group1->exists(std::span(&key, 1)), 1u);
  EXPECT_EQ(*gone->exists(std::span(&key, 1)), 0u);
}

}  // namespace
}  // namespace kvtd::storage
