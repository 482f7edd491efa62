// Redis store against real redis-server processes on loopback (no mocks): one standalone server
// and a three-master cluster made with `redis-cli --cluster create`, all started and stopped here.
#include "kvtd/storage/redis_store.h"

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "kvtd/storage/object_format.h"
#include "redis_server.h"
#include "test_support.h"

namespace kvtd::storage {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using test::base_port;
using test::RedisServer;
constexpr std::uint64_t kObject = 64 * 1024;

std::string temp_dir(const std::string& name) {
  return (fs::path(::testing::TempDir()) / fmt::format("kvtd_redis_{}_{}", ::getpid(), name)).string();
}

std::vector<std::byte> object(std::uint32_t seed) {
  std::vector<std::byte> v(kObject);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

struct Batch {
  std::vector<std::string> keys;
  std::vector<std::vector<std::byte>> data, back;
  std::vector<const std::byte*> srcs;
  std::vector<std::byte*> dsts;
  explicit Batch(std::size_t n, const std::string& prefix = "blk") {
    for (std::size_t i = 0; i < n; ++i) {
      keys.push_back(fmt::format("{}{}", prefix, i));
      data.push_back(object(static_cast<std::uint32_t>(i + 1)));
      back.emplace_back(kObject);
    }
    for (std::size_t i = 0; i < n; ++i) {
      srcs.push_back(data[i].data());
      dsts.push_back(back[i].data());
    }
  }
};

RedisStoreOptions options(std::vector<std::string> endpoints, bool cluster = false, std::string model = "llama") {
  RedisStoreOptions o;
  o.store = StoreOptions{std::move(model), 0x1234, kObject};
  o.endpoints = std::move(endpoints);
  o.cluster = cluster;
  o.timeout_ms = 1000;
  o.max_backoff_ms = 200;
  return o;
}

class RedisStandalone : public ::testing::Test {
 protected:
  test::Watchdog dog_{120};
  std::string dir_ = temp_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
  RedisServer server_{base_port(), {}, dir_};
  void TearDown() override { fs::remove_all(dir_); }
  std::unique_ptr<ObjectStore> open(RedisStoreOptions o) {
    auto s = open_redis_store(o);
    EXPECT_TRUE(s.ok()) << s.error().message;
    return s.ok() ? std::move(s).value() : nullptr;
  }
};

TEST_F(RedisStandalone, PipelinedBatchRoundTripAndLeadingExists) {
  ASSERT_TRUE(server_.ready());
  auto s = open(options({server_.endpoint()}));
  Batch b(32);
  auto put = write_from(*s, b.keys, b.srcs, kObject);
  ASSERT_TRUE(put.ok()) << put.error().message;
  for (auto r : *put) ASSERT_EQ(r, ObjectResult::kOk);
  auto got = read_to(*s, b.keys, b.dsts, kObject);
  ASSERT_TRUE(got.ok());
  for (std::size_t i = 0; i < 32; ++i) {
    EXPECT_EQ((*got)[i], ObjectResult::kOk);
    EXPECT_EQ(b.back[i], b.data[i]);
  }
  EXPECT_EQ(*s->exists(b.keys), 32u);
  const std::string hole[1] = {"blk7"};
  ASSERT_TRUE(s->remove(hole).ok());
  EXPECT_EQ(*s->exists(b.keys), 7u);
  EXPECT_EQ(s->stats().hits, 32u);
}

TEST_F(RedisStandalone, OverwrittenTruncatedAndForeignValuesAreMisses) {
  ASSERT_TRUE(server_.ready());
  auto s = open(options({server_.endpoint()}));
  Batch b(3);
  ASSERT_TRUE(write_from(*s, b.keys, b.srcs, kObject).ok());
  StoreOptions so{"llama", 0x1234, kObject};
  const std::string k0 = "kvtd:" + namespaced_key(so, "blk0"), k1 = "kvtd:" + namespaced_key(so, "blk1"),
                    k2 = "kvtd:" + namespaced_key(so, "blk2");
  EXPECT_EQ(server_.command({"SETRANGE", k0, "100", "X"}), std::to_string(sizeof(ObjectHeader) + kObject));
  EXPECT_EQ(server_.command({"SET", k1, "short"}), "OK");
  const auto raw2 = server_.command({"GET", k2});
  // The same bytes under another key are foreign: the header's key hash does not match.
  EXPECT_EQ(server_.command({"SET", "kvtd:" + namespaced_key(so, "blk9"), raw2}), "OK");
  const std::string keys[4] = {"blk0", "blk1", "blk2", "blk9"};
  std::vector<std::byte> out(4 * kObject);
  std::byte* dsts[4] = {out.data(), out.data() + kObject, out.data() + 2 * kObject, out.data() + 3 * kObject};
  auto got = read_to(*s, keys, dsts, kObject);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)[0], ObjectResult::kCorrupt);
  EXPECT_EQ((*got)[1], ObjectResult::kCorrupt);
  EXPECT_EQ((*got)[2], ObjectResult::kOk);
  EXPECT_EQ((*got)[3], ObjectResult::kCorrupt);
  EXPECT_EQ(s->stats().corrupt, 3u);
  // Another model's namespace does not see them at all.
  auto other = open(options({server_.endpoint()}, false, "qwen"));
  std::byte* one[1] = {out.data()};
  EXPECT_EQ((*read_to(*other, std::span<const std::string>(keys + 2, 1), one, kObject))[0], ObjectResult::kMissing);
}

// Zero-copy puts once raised SIGPIPE on a dead server and killed the process.
TEST_F(RedisStandalone, KilledServerFailsPutsWithoutSigpipeAndReconnectsAfterRestart) {
  ASSERT_TRUE(server_.ready());
  auto s = open(options({server_.endpoint()}));
  Batch b(8);
  ASSERT_TRUE(write_from(*s, b.keys, b.srcs, kObject).ok());
  server_.kill9();
  const auto t0 = std::chrono::steady_clock::now();
  auto put = write_from(*s, b.keys, b.srcs, kObject);
  ASSERT_TRUE(put.ok());
  for (const auto& r : *put) {
    EXPECT_EQ(r, ObjectResult::kFailed);
    EXPECT_FALSE(r.error.empty()) << "each failed key says why";
  }
  auto ex = s->exists(b.keys);
  ASSERT_FALSE(ex.ok());
  EXPECT_EQ(ex.error().code, StorageErrc::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << "a dead server must not hang the call";
  server_.start();  // same port, empty (no persistence)
  ASSERT_TRUE(server_.ready());
  ASSERT_TRUE(test::eventually(
      [&] {
        auto r = write_from(*s, b.keys, b.srcs, kObject);
        return r.ok() && (*r)[0] == ObjectResult::kOk;
      },
      5s));
  EXPECT_EQ(*s->exists(b.keys), 8u);
}

// After a Redis restart the next two storage tasks failed storage_unavailable:
// the idle connection was found stale only on use, then a 50 ms backoff refused the next try.
// A command that fails on a connection made before the call is retried once on a fresh one.
TEST_F(RedisStandalone, TheFirstCallsAfterAServerRestartSucceed) {
  ASSERT_TRUE(server_.ready());
  auto s = open(options({server_.endpoint()}));
  Batch b(4);
  ASSERT_TRUE(write_from(*s, b.keys, b.srcs, kObject).ok());
  server_.kill9();
  server_.start();  // restarted while the store's connection sat idle
  ASSERT_TRUE(server_.ready());
  auto put = write_from(*s, b.keys, b.srcs, kObject);  // the very first call after the restart
  ASSERT_TRUE(put.ok()) << put.error().message;
  for (const auto& r : *put) EXPECT_EQ(r, ObjectResult::kOk) << r.error;
  auto ex = s->exists(b.keys);
  ASSERT_TRUE(ex.ok()) << ex.error().message;
  EXPECT_EQ(*ex, 4u);
  server_.kill9();
  server_.start();
  ASSERT_TRUE(server_.ready());
  auto got = read_to(*s, b.keys, b.dsts, kObject);  // a read after a restart: a miss (no persistence), not a failure
  ASSERT_TRUE(got.ok());
  for (const auto& r : *got) EXPECT_EQ(r, ObjectResult::kMissing) << r.error;
}

TEST_F(RedisStandalone, ServerKilledMidBatchFailsThatBatchWithinTheDeadline) {
  ASSERT_TRUE(server_.ready());
  auto o = options({server_.endpoint()});
  auto s = open(o);
  Batch warm(1, "warm");
  ASSERT_TRUE(write_from(*s, warm.keys, warm.srcs, kObject).ok());  // connected
  // Certainly mid-batch: the server is frozen, so the 16 MiB pipeline fills the socket buffers
  // and the put is stuck writing when the server dies. (A kill after a fixed sleep could land
  // before or after the batch, and the test then asserted only that put returned.)
  server_.freeze();
  Batch big(256, "mid");
  BatchResult put = std::vector<KeyResult>{};
  std::thread writer([&] { put = write_from(*s, big.keys, big.srcs, kObject); });
  std::this_thread::sleep_for(100ms);
  server_.kill9();
  const auto t0 = std::chrono::steady_clock::now();
  writer.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  ASSERT_TRUE(put.ok());  // per-key results
  ASSERT_EQ(put->size(), big.keys.size());
  // No reply ever came back, so no key may claim to be stored.
  for (std::size_t i = 0; i < put->size(); ++i) {
    EXPECT_EQ((*put)[i], ObjectResult::kFailed) << "key " << i;
    EXPECT_FALSE((*put)[i].error.empty()) << "key " << i << " says why it failed";
  }
  server_.start();
  ASSERT_TRUE(server_.ready());
  ASSERT_TRUE(test::eventually(
      [&] {
        auto r = write_from(*s, big.keys, big.srcs, kObject);
        return r.ok() && std::all_of(r->begin(), r->end(), [](const KeyResult& x) { return x == ObjectResult::kOk; });
      },
      5s));
  auto got = read_to(*s, big.keys, big.dsts, kObject);
  ASSERT_TRUE(got.ok());
  for (std::size_t i = 0; i < big.keys.size(); ++i) ASSERT_EQ(big.back[i], big.data[i]);
}

// The Redis store once accepted any non-empty model id, unlike the file store.
TEST(RedisOptions, ModelIdFollowsTheSameNameRuleAsTheFileStore) {
  auto o = options({"127.0.0.1:1"}, false, "a/b");
  auto s = open_redis_store(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, StorageErrc::kInvalidArgument);
  EXPECT_NE(s.error().message.find("model id"), std::string::npos) << s.error().message;
}

TEST(RedisPassword, ComesFromAnEnvironmentVariableOrAFile) {
  test::Watchdog dog(60);
  const auto dir = temp_dir("password");
  RedisServer server(base_port() + 1, {"--requirepass", "s3cret"}, dir);
  ASSERT_TRUE(server.ready());
  Batch b(2);
  auto o = options({server.endpoint()});
  o.password_env = "KVTD_TEST_REDIS_PASSWORD";
  ::unsetenv("KVTD_TEST_REDIS_PASSWORD");
  auto missing = open_redis_store(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.error().message.find("KVTD_TEST_REDIS_PASSWORD"), std::string::npos);
  ::setenv("KVTD_TEST_REDIS_PASSWORD", "s3cret", 1);
  auto s = open_redis_store(o);
  ASSERT_TRUE(s.ok());
  auto r = write_from(**s, b.keys, b.srcs, kObject);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)[0], ObjectResult::kOk);

  o.password_env.clear();
  o.password_file = dir + "/pw";
  std::ofstream(o.password_file) << "wrong\n";
  auto bad = open_redis_store(o);
  ASSERT_TRUE(bad.ok());
  auto denied = read_to(**bad, b.keys, b.dsts, kObject);
  ASSERT_TRUE(denied.ok());
  EXPECT_EQ((*denied)[0], ObjectResult::kFailed);
  fs::remove_all(dir);
}

// Garbage collection by SCAN (never KEYS) and objects that expire on their own.
GcRequest keep_version(int weight_version) {
  GcRequest r;
  r.keep_fingerprints = {0x1234};
  const std::string tail = fmt::format("-v{}", weight_version);
  r.keep_name = [tail](const std::string& n) { return n.size() > tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0; };
  return r;
}

TEST_F(RedisStandalone, CollectionRemovesOtherVersionsByScanAndKeepsWhatLoads) {
  ASSERT_TRUE(server_.ready());
  auto s = open(options({server_.endpoint()}));
  Batch old_version(40, "old"), current(8, "cur");
  for (auto& k : old_version.keys) k += "-v1";
  for (auto& k : current.keys) k += "-v2";
  ASSERT_TRUE(write_from(*s, old_version.keys, old_version.srcs, kObject).ok());
  ASSERT_TRUE(write_from(*s, current.keys, current.srcs, kObject).ok());
  auto other_model = open(options({server_.endpoint()}, false, "mistral"));
  Batch theirs(3, "theirs");
  ASSERT_TRUE(write_from(*other_model, theirs.keys, theirs.srcs, kObject).ok());
  server_.command({"SET", "unrelated", "x"});  // not kvtd's: never looked at

  auto dry = keep_version(2);
  dry.dry_run = true;
  auto counted = s->collect(dry);
  ASSERT_TRUE(counted.ok()) << counted.error().message;
  EXPECT_EQ(counted->removed, 40u);
  EXPECT_EQ(*s->exists(old_version.keys), 40u);

  auto done = s->collect(keep_version(2));
  ASSERT_TRUE(done.ok()) << done.error().message;
  EXPECT_TRUE(done->complete);
  EXPECT_EQ(done->examined, 51u);
  EXPECT_EQ(done->removed, 40u);
  EXPECT_EQ(done->removed_bytes, 40 * (kObject + sizeof(ObjectHeader)));
  EXPECT_EQ(*s->exists(old_version.keys), 0u);
  auto got = read_to(*s, current.keys, current.dsts, kObject);
  ASSERT_TRUE(got.ok());
  for (std::size_t i = 0; i < current.keys.size(); ++i) {
    EXPECT_EQ((*got)[i], ObjectResult::kOk);
    EXPECT_EQ(current.back[i], current.data[i]);
  }
  EXPECT_EQ(*other_model->exists(theirs.keys), 3u);
  EXPECT_EQ(server_.command({"GET", "unrelated"}), "x");
  // Keys that merely look like an old version's object (a name kvtd's pattern
  // matches, bytes kvtd did not write) are never removed; before, gc unlinked them.
  server_.command({"SET", "kvtd:llama/0000000000001234/notes-v1", "written by someone else"});
  server_.command({"SET", "kvtd:llama/00000000deadbeef/notes-v1", std::string(64, 'x')});
  auto foreign = s->collect(keep_version(2));
  ASSERT_TRUE(foreign.ok()) << foreign.error().message;
  EXPECT_EQ(foreign->removed, 0u);
  EXPECT_EQ(foreign->foreign, 2u);
  EXPECT_EQ(server_.command({"GET", "kvtd:llama/0000000000001234/notes-v1"}), "written by someone else");
  // The server's own command statistics: SCAN, never KEYS (which blocks it for the whole keyspace).
  const std::string stats = server_.command({"INFO", "commandstats"});
  EXPECT_NE(stats.find("cmdstat_scan:"), std::string::npos) << stats;
  EXPECT_EQ(stats.find("cmdstat_keys:"), std::string::npos) << stats;
}

TEST_F(RedisStandalone, ATtlMakesObjectsExpireOnTheServer) {
  ASSERT_TRUE(server_.ready());
  auto o = options({server_.endpoint()});
  o.ttl_s = 600;
  auto s = open(o);
  Batch b(2);
  ASSERT_TRUE(write_from(*s, b.keys, b.srcs, kObject).ok());
  const std::string ttl = server_.command({"TTL", "kvtd:llama/0000000000001234/blk0"});
  ASSERT_FALSE(ttl.empty());
  const long seconds = std::stol(ttl);
  EXPECT_GT(seconds, 590);
  EXPECT_LE(seconds, 600);
  auto got = read_to(*s, b.keys, b.dsts, kObject);  // a SET with EX still stores the whole object
  ASSERT_TRUE(got.ok());
  EXPECT_EQ((*got)[1], ObjectResult::kOk);
  EXPECT_EQ(b.back[1], b.data[1]);
  auto plain = open(options({server_.endpoint()}));
  Batch c(1, "forever");
  ASSERT_TRUE(write_from(*plain, c.keys, c.srcs, kObject).ok());
  EXPECT_EQ(server_.command({"TTL", "kvtd:llama/0000000000001234/forever0"}), "-1");
}

class RedisClusterTest : public ::testing::Test {
 protected:
  test::Watchdog dog_{120};
  std::string dir_ = temp_dir("cluster");
  std::vector<std::unique_ptr<RedisServer>> nodes_;

  void SetUp() override {
    std::vector<std::string> create{"/usr/bin/redis-cli", "--cluster", "create"};
    for (int i = 0; i < 3; ++i) {
      const int port = base_port() + 2 + i;
      nodes_.push_back(std::make_unique<RedisServer>(
          port, std::vector<std::string>{"--cluster-enabled", "yes", "--cluster-config-file",
                                         fmt::format("nodes-{}.conf", port), "--cluster-node-timeout", "2000"},
          fmt::format("{}/{}", dir_, port)));
      ASSERT_TRUE(nodes_.back()->ready());
      create.push_back(nodes_.back()->endpoint());
    }
    create.insert(create.end(), {"--cluster-replicas", "0", "--cluster-yes"});
    test::Child cli(create, dir_ + "/create.log");
    ASSERT_EQ(cli.wait_exit(60s), 0) << test::read_file(dir_ + "/create.log");
    ASSERT_TRUE(test::eventually(
        [&] {
          for (auto& n : nodes_)
            if (n->command({"CLUSTER", "INFO"}).find("cluster_state:ok") == std::string::npos) return false;
          return true;
        },
        30s));
  }
  void TearDown() override {
    nodes_.clear();
    fs::remove_all(dir_);
  }
  std::string node_id(RedisServer& n) { return n.command({"CLUSTER", "MYID"}); }
};

TEST_F(RedisClusterTest, BatchesSpanAllMastersAndMovedIsFollowedAfterASlotMigration) {
  auto o = options({nodes_[0]->endpoint()}, true);
  auto s = open_redis_store(o);
  ASSERT_TRUE(s.ok()) << s.error().message;
  Batch b(48);
  auto put = write_from(**s, b.keys, b.srcs, kObject);
  ASSERT_TRUE(put.ok());
  for (auto r : *put) ASSERT_EQ(r, ObjectResult::kOk);
  std::size_t on_each[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) on_each[i] = std::stoul(nodes_[static_cast<std::size_t>(i)]->command({"DBSIZE"}));
  EXPECT_GT(on_each[0], 0u);
  EXPECT_GT(on_each[1], 0u);
  EXPECT_GT(on_each[2], 0u);

  // Move the slot of blk3 to another master, keys included; the store's map is now stale.
  StoreOptions so{"llama", 0x1234, kObject};
  const std::string key = "kvtd:" + namespaced_key(so, "blk3");
  const auto slot = redis_cluster_slot(key);
  std::size_t from = 3;
  for (std::size_t i = 0; i < 3; ++i)
    if (nodes_[i]->command({"GET", key}).rfind("MOVED", 0) != 0) from = i;
  ASSERT_LT(from, 3u);
  const std::size_t to = (from + 1) % 3;
  const auto to_id = node_id(*nodes_[to]), from_id = node_id(*nodes_[from]);
  const auto slot_s = std::to_string(slot);
  EXPECT_EQ(nodes_[to]->command({"CLUSTER", "SETSLOT", slot_s, "IMPORTING", from_id}), "OK");
  EXPECT_EQ(nodes_[from]->command({"CLUSTER", "SETSLOT", slot_s, "MIGRATING", to_id}), "OK");
  EXPECT_EQ(nodes_[from]->command({"MIGRATE", "127.0.0.1", std::to_string(nodes_[to]->port()), key, "0", "5000"}), "OK");

  // Mid-migration the old owner answers ASK for the moved key.
  {
    const std::string k[1] = {"blk3"};
    std::byte* d[1] = {b.back[3].data()};
    auto got = read_to(**s, k, d, kObject);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ((*got)[0], ObjectResult::kOk) << "ASK redirect not followed";
    EXPECT_EQ(b.back[3], b.data[3]);
  }
  for (auto& n : nodes_) EXPECT_EQ(n->command({"CLUSTER", "SETSLOT", slot_s, "NODE", to_id}), "OK");

  std::fill(b.back[3].begin(), b.back[3].end(), std::byte{0});
  auto got = read_to(**s, b.keys, b.dsts, kObject);
  ASSERT_TRUE(got.ok());
  for (std::size_t i = 0; i < b.keys.size(); ++i) {
    EXPECT_EQ((*got)[i], ObjectResult::kOk) << b.keys[i];
    EXPECT_EQ(b.back[i], b.data[i]) << b.keys[i];
  }
  EXPECT_EQ(*(*s)->exists(b.keys), b.keys.size());
}

}  // namespace
}  // namespace kvtd::storage

namespace kvtd::storage {
namespace {

// The collection walks every master of a cluster (SCAN is per node), not only the one it was given.
TEST_F(RedisClusterTest, CollectionScansEveryMaster) {
  auto s = open_redis_store(options({nodes_[0]->endpoint()}, true));
  ASSERT_TRUE(s.ok()) << s.error().message;
  Batch old_version(48, "old"), current(8, "cur");
  for (auto& k : old_version.keys) k += "-v1";
  for (auto& k : current.keys) k += "-v2";
  ASSERT_TRUE(write_from(**s, old_version.keys, old_version.srcs, kObject).ok());
  ASSERT_TRUE(write_from(**s, current.keys, current.srcs, kObject).ok());
  int masters_holding_old = 0;
  for (auto& n : nodes_) masters_holding_old += n->command({"DBSIZE"}) != "0";
  ASSERT_EQ(masters_holding_old, 3) << "the keys should spread over all three masters";
  auto done = (*s)->collect(keep_version(2));
  ASSERT_TRUE(done.ok()) << done.error().message;
  EXPECT_EQ(done->examined, 56u);
  EXPECT_EQ(done->removed, 48u);
  EXPECT_EQ(*(*s)->exists(old_version.keys), 0u);
  EXPECT_EQ(*(*s)->exists(current.keys), 8u);
}

}  // namespace
}  // namespace kvtd::storage
