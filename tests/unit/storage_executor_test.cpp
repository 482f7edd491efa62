// The storage executor against the scripted store: every read and write path moves the exact
// bytes; a load the store cut short is storage_unavailable, not a miss; a failed write names its
// own key's cause; a CANCEL stops a write between small steps, and it answers truthfully whether
// it will stop the task.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "endpoint_helpers.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/engine/engine_session.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/storage/object_store.h"
#include "scripted_store.h"
#include "test_support.h"

namespace kvtd::daemon {
namespace {

using proto::TaskKind;
using proto::TaskStatus;
using storage::ObjectResult;
using storage::StorageErrc;

using proto::Outcome;

class StorageExecutorTest : public ::testing::Test {
 protected:
  static constexpr std::size_t kObject = 1 << 20;  // 1 MiB objects: steps of 4 objects
  static constexpr std::int32_t kBlocks = 24;
  test::Watchdog dog_{60};
  std::string suffix_ = test::unique_suffix("storexec");
  proto::CacheGeometry g_ = test::small_geometry(1);
  std::unique_ptr<engine::EngineSession> engine_;
  std::unique_ptr<endpoint::RankEndpoint> ep_;
  test::Heartbeats heartbeats_;  // the daemon's serve loop, for ep_ (and any other rank here)
  std::unique_ptr<DeviceBackend> backend_ = make_host_backend();
  std::vector<std::byte> device_ = std::vector<std::byte>(kObject * kBlocks, std::byte{7});
  storage::StoreCapabilities capabilities_;  // the store's, set before SetUp
  std::uint32_t backup_max_age_ms_ = 10'000;
  proto::ObjectSlicing slicing_;  // how blocks are cut into objects, set before SetUp
  std::unique_ptr<test::ScriptedStore> store_;
  // Records each rank's completions in its map (the executors' listener).
  struct Recorder final : StorageListener {
    Recorder(StorageExecutorTest& test, std::map<std::uint64_t, Outcome>& done) : test_(test), done_(done) {}
    void storage_completed(const proto::TaskRecordHeader& h, const Outcome& o, std::int64_t) override {
      std::lock_guard<std::mutex> g(test_.mu_);
      done_[h.task_id] = o;
      test_.cv_.notify_all();
    }
    void storage_released(const StorageWork&) override {}
    StorageExecutorTest& test_;
    std::map<std::uint64_t, Outcome>& done_;
  };
  std::vector<std::unique_ptr<Recorder>> listeners_;  // before the executors: they outlive them
  std::unique_ptr<StorageExecutor> exec_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, Outcome> done_;
  std::uint64_t seq_ = 0;

  // An executor of `ep` over the scripted store, loading into `device`, whose completions land in
  // `done`.
  std::unique_ptr<StorageExecutor> make_executor(endpoint::RankEndpoint& ep, std::vector<std::byte>& device,
                                                 std::map<std::uint64_t, Outcome>& done) {
    StorageTargets t;
    t.store = store_.get();
    t.store_name = "scripted store";
    t.config.io_threads = 1;
    t.config.staging_mib = 8;
    t.config.write_policy = config::WritePolicy::kWriteThrough;  // backups are stored
    t.config.backup_max_age_ms = backup_max_age_ms_;
    t.slicing = slicing_;
    t.object_bytes = kObject / slicing_.parts;
    t.device_tensors.push_back(kernels::LayerTensor{device.data(), kObject, kObject});
    listeners_.push_back(std::make_unique<Recorder>(*this, done));
    auto e = StorageExecutor::create(ep, *backend_, *backend_, nullptr, std::move(t), *listeners_.back());
    EXPECT_TRUE(e.ok()) << e.error().message;
    return e.ok() ? std::move(e).value() : nullptr;
  }

  void SetUp() override {
    store_ = std::make_unique<test::ScriptedStore>(kObject / slicing_.parts, capabilities_);
    engine::SessionOptions o;
    o.suffix = suffix_;
    o.geometry = g_;
    o.service_period_ns = 2'000'000;
    auto s = engine::EngineSession::create(o);
    ASSERT_TRUE(s.ok()) << s.error().message;
    engine_ = std::move(s).value();
    ASSERT_TRUE(engine_->create_host_device_tensors().ok());
    ASSERT_TRUE(engine_->publish().ok());
    auto ep = endpoint::RankEndpoint::attach(test::endpoint_options(suffix_, 0, g_));
    ASSERT_TRUE(ep.ok()) << ep.error().message;
    ep_ = std::move(ep).value();
    heartbeats_.watch(*ep_);
    exec_ = make_executor(*ep_, device_, done_);
    ASSERT_NE(exec_, nullptr);
  }
  void TearDown() override {
    heartbeats_.stop();
    exec_.reset();
    ep_.reset();
    engine_.reset();
  }

  // Task `id` of `kind` over `keys` on rank 0, next in ring order (its blocks left to the caller).
  StorageWork work(TaskKind kind, std::uint64_t id, const std::vector<std::string>& keys) {
    StorageWork w;
    w.header.task_id = id;
    w.header.seq = ++seq_;
    w.header.kind = static_cast<std::uint16_t>(kind);
    w.epoch = ep_->epoch();
    w.section.keys = keys;
    return w;
  }
  std::uint64_t submit(TaskKind kind, std::uint64_t id, const std::vector<std::string>& keys) {
    StorageWork w = work(kind, id, keys);
    for (std::size_t i = 0; i < keys.size(); ++i) w.blocks.push_back(static_cast<std::int32_t>(i));
    exec_->submit(std::move(w));
    return id;
  }
  Outcome wait(std::uint64_t id) {
    std::unique_lock<std::mutex> lk(mu_);
    EXPECT_TRUE(cv_.wait_for(lk, std::chrono::seconds(20), [&] { return done_.count(id) != 0; })) << "task " << id;
    return done_.count(id) ? done_[id] : Outcome::failed(TaskStatus::kInternal, "no completion");
  }
  static std::vector<std::string> keys(const std::string& prefix, int n) {
    std::vector<std::string> k;
    for (int i = 0; i < n; ++i) k.push_back(fmt::format("{}{}", prefix, i));
    return k;
  }
};

// A store that dies mid-load read as a miss (ok, fewer blocks): the engine could not tell
// "not stored" from "store down".
TEST_F(StorageExecutorTest, ALoadTheStoreCutShortIsUnavailableWithTheBlocksBeforeIt) {
  ASSERT_EQ(wait(submit(TaskKind::kStorageWrite, 1, keys("a", 6))).status, TaskStatus::kOk);
  std::vector<std::string> stored;
  // The stored names carry the weight version and rank: read them back through exists order.
  store_->fail_on_read["a2.w0-0.r0"] = "Connection reset by peer";
  const auto cut = wait(submit(TaskKind::kStorageRead, 2, keys("a", 6)));
  EXPECT_EQ(cut.status, TaskStatus::kStorageUnavailable) << cut.message;
  EXPECT_EQ(cut.blocks, 2u);
  EXPECT_NE(cut.message.find("Connection reset by peer"), std::string::npos) << cut.message;
  // A real miss stays a miss: ok with the blocks before it.
  store_->fail_on_read.clear();
  store_->vanish_on_read.insert("b9.w0-0.r0");
  ASSERT_EQ(wait(submit(TaskKind::kStorageWrite, 3, keys("b", 3))).status, TaskStatus::kOk);
  auto with_hole = keys("b", 3);
  with_hole.push_back("b9");
  const auto miss = wait(submit(TaskKind::kStorageRead, 4, with_hole));
  EXPECT_EQ(miss.status, TaskStatus::kOk) << miss.message;
  EXPECT_EQ(miss.blocks, 3u);
}

// A failed write's message came from a store-wide "last error" that another worker's failure
// could overwrite: each key's cause now comes back with its result.
TEST_F(StorageExecutorTest, AFailedWriteNamesItsOwnKeysCause) {
  store_->fail_on_write["e2.w0-0.r0"] = "No space left on device";
  store_->fail_on_write["e3.w0-0.r0"] = "Permission denied";
  const auto failed = wait(submit(TaskKind::kStorageWrite, 5, keys("e", 4)));
  EXPECT_EQ(failed.status, TaskStatus::kStorageError) << failed.message;
  EXPECT_NE(failed.message.find("2 of 4 objects not written: No space left on device (write e2"), std::string::npos)
      << failed.message;
}

// A backup that phase 1 skipped (it had waited past --storage-backup-max-age-ms) left phase 1
// looking busy since it took that backup, so every backup arriving after the age bound was
// skipped as "the store has held storage tasks" while the store was idle.
TEST_F(StorageExecutorTest, ABackupSkippedInPhaseOneLeavesLaterBackupsStored) {
  backup_max_age_ms_ = 100;
  exec_.reset();
  exec_ = make_executor(*ep_, device_, done_);
  auto backup = [&](std::uint64_t id, std::int64_t submit_ns) {
    StorageWork w;
    w.header.task_id = id;
    w.header.seq = ++seq_;
    w.header.kind = static_cast<std::uint16_t>(TaskKind::kStorageWrite);
    w.header.flags = proto::kTaskFlagPolicyBackup;
    w.header.submit_ns = submit_ns;
    w.epoch = ep_->epoch();
    w.section.keys = keys(fmt::format("g{}_", id), 2);
    w.blocks = {0, 1};
    exec_->submit(std::move(w));
    return id;
  };
  const auto old = wait(backup(20, ipc::monotonic_now_ns() - 10'000'000'000));
  EXPECT_EQ(old.status, TaskStatus::kBackupSkipped) << old.message;
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * backup_max_age_ms_));  // the store stays idle
  const auto fresh = wait(backup(21, ipc::monotonic_now_ns()));
  EXPECT_EQ(fresh.status, TaskStatus::kOk) << fresh.message;
  EXPECT_EQ(store_->size(), 2u);
}

// Cancellation was checked between chunks of up to 2,048 objects, so a CANCEL answered
// "will stop" for a write that then completed. Now a write stops at its next step (at most
// ~4 MiB), and a CANCEL that comes once the last step began answers that it will not stop it.
TEST_F(StorageExecutorTest, ACancelStopsAWriteAtItsNextStepAndAnswersTruthfully) {
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  int entered = 0;
  bool open = false;
  store_->on_write = [&] {
    std::unique_lock<std::mutex> lk(gate_mu);
    ++entered;
    gate_cv.notify_all();
    gate_cv.wait(lk, [&] { return open; });
  };
  auto release = [&] {
    std::lock_guard<std::mutex> g(gate_mu);
    open = true;
    gate_cv.notify_all();
  };
  auto wait_entered = [&](int n) {
    std::unique_lock<std::mutex> lk(gate_mu);
    ASSERT_TRUE(gate_cv.wait_for(lk, std::chrono::seconds(20), [&] { return entered >= n; }));
  };
  // 20 objects: five steps of four. Cancelled while the first step is being written.
  submit(TaskKind::kStorageWrite, 10, keys("c", 20));
  wait_entered(1);
  EXPECT_TRUE(exec_->cancel(10)) << "not past its last step: it will stop";
  release();
  const auto stopped = wait(10);
  EXPECT_EQ(stopped.status, TaskStatus::kCancelled) << stopped.message;
  EXPECT_EQ(stopped.blocks, 4u) << "it stopped after the step in flight";
  EXPECT_EQ(store_->size(), 4u);

  // Four objects: one step, which is the last: a CANCEL during it cannot stop it, and says so.
  {
    std::lock_guard<std::mutex> g(gate_mu);
    open = false;
    entered = 0;
  }
  submit(TaskKind::kStorageWrite, 11, keys("d", 4));
  wait_entered(1);
  EXPECT_FALSE(exec_->cancel(11)) << "past its last check: saying it stops would be a lie";
  release();
  const auto finished = wait(11);
  EXPECT_EQ(finished.status, TaskStatus::kOk) << finished.message;
  EXPECT_EQ(finished.blocks, 4u);
}

// The fixture plays a serving daemon: a rank quiet past the engine's rank timeout (3 s) lost its
// grant, and the task after it was dropped without a completion (under a loaded CI machine a
// test's write alone took that long, and its read then waited in vain).
TEST_F(StorageExecutorTest, ARankServedPastTheEnginesRankTimeoutStillAnswers) {
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));
  EXPECT_TRUE(ep_->granted());
  const auto found = wait(submit(TaskKind::kStorageQuery, 1, keys("q", 2)));
  EXPECT_EQ(found.status, TaskStatus::kOk) << found.message;
  EXPECT_EQ(found.blocks, 0u);
}

// Every path between the blocks and the store, by what the store can do: read in place or into
// verified copies, write from the blocks' pieces or through staging. Each moves the exact bytes,
// and a corrupt object is never counted loaded, even where its bytes landed in the block first.
class StorePathTest : public StorageExecutorTest,
                      public ::testing::WithParamInterface<std::pair<bool, bool>> {
 protected:
  StorePathTest() { capabilities_ = {.reads_in_place = GetParam().first, .writes_pieces = GetParam().second}; }
};

TEST_P(StorePathTest, WritesAndLoadsMoveTheExactBytes) {
  for (std::size_t i = 0; i < device_.size(); ++i) device_[i] = static_cast<std::byte>((i * 131 + i / kObject) & 0xff);
  const auto written = device_;
  ASSERT_EQ(wait(submit(TaskKind::kStorageWrite, 1, keys("x", 6))).status, TaskStatus::kOk);
  for (std::size_t b = 0; b < 6; ++b) {
    const auto object = store_->stored(fmt::format("x{}.w0-0.r0", b));
    ASSERT_EQ(object.size(), kObject) << "block " << b;
    EXPECT_EQ(0, std::memcmp(object.data(), written.data() + b * kObject, kObject)) << "block " << b;
  }
  std::fill(device_.begin(), device_.end(), std::byte{0});
  store_->corrupt_on_read.insert("x4.w0-0.r0");
  const auto loaded = wait(submit(TaskKind::kStorageRead, 2, keys("x", 6)));
  EXPECT_EQ(loaded.status, TaskStatus::kOk) << loaded.message;
  EXPECT_EQ(loaded.blocks, 4u) << "a corrupt object is a miss: the blocks before it are loaded";
  EXPECT_EQ(0, std::memcmp(device_.data(), written.data(), 4 * kObject));
}

INSTANTIATE_TEST_SUITE_P(Capabilities, StorePathTest,
                         ::testing::Values(std::pair{false, false}, std::pair{true, false}, std::pair{false, true},
                                           std::pair{true, true}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.first ? "InPlace" : "Verified") +
                                  (param_info.param.second ? "Pieces" : "Staged");
                         });

// Objects by head (--storage-object-heads): a block is several objects, each the same share of
// every tensor's block, and a key is stored, found and loaded only when every part of it is.
class PartsTest : public StorageExecutorTest {
 protected:
  PartsTest() {
    slicing_.by_head = true;
    slicing_.parts = 2;
    slicing_.heads_per_part = 1;
    slicing_.first_head = 4;
    slicing_.total_heads = 8;
  }
};

TEST_F(PartsTest, EachPartHoldsItsShareAndAKeyLoadsOnlyWhole) {
  for (std::size_t i = 0; i < device_.size(); ++i) device_[i] = static_cast<std::byte>(i * 7 / kObject + i % 251);
  const std::vector<std::byte> written = device_;
  store_->fail_on_write["h1.w0-0.h5"] = "No space left on device";  // key 1 lacks its second part
  const auto w = wait(submit(TaskKind::kStorageWrite, 1, keys("h", 4)));
  EXPECT_EQ(w.status, TaskStatus::kStorageError) << w.message;
  EXPECT_EQ(store_->size(), 7u);
  for (int k : {0, 2, 3})
    for (int part = 0; part < 2; ++part) {
      const auto got = store_->stored(fmt::format("h{}.w0-0.h{}", k, 4 + part));
      const auto* share = written.data() + k * kObject + part * (kObject / 2);
      ASSERT_EQ(got.size(), kObject / 2);
      EXPECT_EQ(std::memcmp(got.data(), share, got.size()), 0) << "key " << k << " part " << part;
    }
  std::fill(device_.begin(), device_.end(), std::byte{0});
  const auto r = wait(submit(TaskKind::kStorageRead, 2, keys("h", 4)));
  EXPECT_EQ(r.status, TaskStatus::kOk) << r.message;
  EXPECT_EQ(r.blocks, 1u) << "key 1 lacks a part: the prefix found ends before it";
  EXPECT_EQ(std::memcmp(device_.data(), written.data(), kObject), 0);

  // Found whole, then one part fails verification: the key is not loaded.
  store_->corrupt_on_read.insert("h3.w0-0.h5");
  const auto r2 = wait(submit(TaskKind::kStorageRead, 3, {"h2", "h3", "h0"}));
  EXPECT_EQ(r2.status, TaskStatus::kOk) << r2.message;
  EXPECT_EQ(r2.blocks, 1u) << "h3's second part is corrupt";
}

// The storage phases across two ranks in one process (the agreement through the session's real
// shared memory, a scripted store): each rank loads only the prefix every rank has, the MIN.
class TwoRankStorageTest : public StorageExecutorTest {
 protected:
  TwoRankStorageTest() { g_ = test::small_geometry(2); }  // before SetUp makes the session
  std::unique_ptr<endpoint::RankEndpoint> ep1_;
  std::unique_ptr<StorageExecutor> exec1_;
  std::map<std::uint64_t, Outcome> done1_;
  std::vector<std::byte> device1_ = std::vector<std::byte>(kObject * kBlocks, std::byte{9});  // rank 1's own tensor

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StorageExecutorTest::SetUp());
    auto ep = endpoint::RankEndpoint::attach(test::endpoint_options(suffix_, 1, g_));
    ASSERT_TRUE(ep.ok()) << ep.error().message;
    ep1_ = std::move(ep).value();
    heartbeats_.watch(*ep1_);
    exec1_ = make_executor(*ep1_, device1_, done1_);
    ASSERT_NE(exec1_, nullptr);
  }
  void TearDown() override {
    heartbeats_.stop();
    exec1_.reset();
    ep1_.reset();
    StorageExecutorTest::TearDown();
  }
  // The same task on both ranks (one sequence number: one agreement).
  void submit_both(TaskKind kind, std::uint64_t id, const std::vector<std::string>& keys0,
                   const std::vector<std::string>& keys1) {
    const std::uint64_t seq = ++seq_;
    for (int r = 0; r < 2; ++r) {
      StorageWork w;
      w.header.task_id = id;
      w.header.seq = seq;
      w.header.kind = static_cast<std::uint16_t>(kind);
      w.epoch = (r == 0 ? ep_ : ep1_)->epoch();
      w.section.keys = r == 0 ? keys0 : keys1;
      for (std::size_t i = 0; i < w.section.keys.size(); ++i) w.blocks.push_back(static_cast<std::int32_t>(i));
      (r == 0 ? exec_ : exec1_)->submit(std::move(w));
    }
  }
  Outcome wait1(std::uint64_t id) {
    std::unique_lock<std::mutex> lk(mu_);
    EXPECT_TRUE(cv_.wait_for(lk, std::chrono::seconds(20), [&] { return done1_.count(id) != 0; })) << "task " << id;
    return done1_.count(id) ? done1_[id] : Outcome::failed(TaskStatus::kInternal, "no completion");
  }
};

TEST_F(TwoRankStorageTest, EachRankLoadsOnlyThePrefixEveryRankHas) {
  // Rank 0 stores four objects, rank 1 only the first two of the same keys.
  submit_both(TaskKind::kStorageWrite, 1, keys("p", 4), keys("p", 2));
  ASSERT_EQ(wait(1).status, TaskStatus::kOk);
  ASSERT_EQ(wait1(1).status, TaskStatus::kOk);
  submit_both(TaskKind::kStorageRead, 2, keys("p", 4), keys("p", 4));
  const auto r0 = wait(2), r1 = wait1(2);
  EXPECT_EQ(r0.status, TaskStatus::kOk) << r0.message;
  EXPECT_EQ(r1.status, TaskStatus::kOk) << r1.message;
  EXPECT_EQ(r0.blocks, 2u) << "rank 0 has four objects but rank 1 only two: the agreed MIN";
  EXPECT_EQ(r1.blocks, 2u);
}

// A session of cache groups (daemon/storage/group_agreement.cpp, group_objects.cpp): a full-attention
// group of 1 MiB blocks beside a state group of 64 KiB slots, each in a store of its own.
class GroupStorageTest : public StorageExecutorTest {
 protected:
  static constexpr std::size_t kState = 64 << 10;
  std::unique_ptr<test::ScriptedStore> state_store_ = std::make_unique<test::ScriptedStore>(kState);
  std::vector<std::byte> state_ = std::vector<std::byte>(kState * 4, std::byte{3});

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(StorageExecutorTest::SetUp());
    exec_.reset();
    StorageTargets t;
    t.store = store_.get();
    t.store_name = "scripted store";
    t.config.io_threads = 1;
    t.config.staging_mib = 8;
    t.layout.num_ranks = 1;
    t.layout.num_groups = 2;
    t.layout.page_tokens = 16;
    t.layout.groups[0].kind = static_cast<std::uint32_t>(proto::GroupKind::kFullAttention);
    t.layout.groups[0].block_tokens = 16;
    t.layout.groups[1].kind = static_cast<std::uint32_t>(proto::GroupKind::kState);
    GroupStorage full, state;
    full.store = store_.get();
    full.device_tensors.push_back(kernels::LayerTensor{device_.data(), kObject, kObject});
    full.object_bytes = kObject;
    state.store = state_store_.get();
    state.device_tensors.push_back(kernels::LayerTensor{state_.data(), kState, kState});
    state.object_bytes = kState;
    state.device_base = kBlocks;
    state.trailing = 1;
    t.groups = {full, state};
    t.object_bytes = kObject;
    listeners_.push_back(std::make_unique<Recorder>(*this, done_));
    auto e = StorageExecutor::create(*ep_, *backend_, *backend_, nullptr, std::move(t), *listeners_.back());
    ASSERT_TRUE(e.ok()) << e.error().message;
    exec_ = std::move(e).value();
  }
  // `keys` with full-attention blocks `full` and state slots `state` (-1: none), group-major.
  std::uint64_t submit_groups(TaskKind kind, std::uint64_t id, const std::vector<std::string>& keys,
                              const std::vector<std::int32_t>& full, const std::vector<std::int32_t>& state) {
    StorageWork w = work(kind, id, keys);
    w.blocks = full;
    for (auto s : state) w.blocks.push_back(s < 0 ? -1 : static_cast<std::int32_t>(kBlocks) + s);
    exec_->submit(std::move(w));
    return id;
  }
};

// A load whose state the store fails to read is storage_unavailable naming the group, and
// reports nothing loaded: the full-attention pages before it are no prefix without their state.
TEST_F(GroupStorageTest, ALoadWhoseStateTheStoreFailsIsUnavailableAndLoadsNothing) {
  ASSERT_EQ(wait(submit_groups(TaskKind::kStorageWrite, 1, keys("g", 3), {0, 1, 2}, {-1, -1, 0})).status,
            TaskStatus::kOk);
  state_store_->fail_on_read["g2.w0-0.r0"] = "Connection reset by peer";
  const auto cut = wait(submit_groups(TaskKind::kStorageRead, 2, keys("g", 3), {5, 6, 7}, {-1, -1, 1}));
  EXPECT_EQ(cut.status, TaskStatus::kStorageUnavailable) << cut.message;
  EXPECT_EQ(cut.blocks, 0u);
  EXPECT_NE(cut.message.find("cache group 1"), std::string::npos) << cut.message;
  EXPECT_NE(cut.message.find("Connection reset by peer"), std::string::npos) << cut.message;
}

// An object gone between the agreement and its read (evicted) is a miss: ok, nothing loaded.
TEST_F(GroupStorageTest, AnObjectGoneBeforeItsReadIsAMissThatLoadsNothing) {
  ASSERT_EQ(wait(submit_groups(TaskKind::kStorageWrite, 1, keys("h", 3), {0, 1, 2}, {-1, -1, 0})).status,
            TaskStatus::kOk);
  store_->vanish_on_read.insert("hx.w0-0.r0");  // there for the agreement, gone for the read
  const auto miss = wait(submit_groups(TaskKind::kStorageRead, 2, {"h0", "hx", "h2"}, {5, 6, 7}, {-1, -1, 1}));
  EXPECT_EQ(miss.status, TaskStatus::kOk) << miss.message;
  EXPECT_EQ(miss.blocks, 0u);
  // Without it the load is whole: the state saved at the third key ends a 3-page prefix.
  store_->vanish_on_read.clear();
  const auto whole = wait(submit_groups(TaskKind::kStorageRead, 3, keys("h", 3), {5, 6, 7}, {-1, -1, 1}));
  EXPECT_EQ(whole.blocks, 3u) << whole.message;
  EXPECT_EQ(std::memcmp(state_.data() + kState, state_.data(), kState), 0) << "slot 1 holds slot 0's state";
}

// A write fails naming its own group and cause; the other group's objects stand.
TEST_F(GroupStorageTest, AFailedWriteOfOneGroupNamesItsCause) {
  state_store_->fail_on_write["w1.w0-0.r0"] = "No space left on device";
  const auto failed = wait(submit_groups(TaskKind::kStorageWrite, 1, keys("w", 2), {0, 1}, {-1, 0}));
  EXPECT_EQ(failed.status, TaskStatus::kStorageError) << failed.message;
  EXPECT_NE(failed.message.find("cache group 1: 1 of 1 objects not written: No space left on device (write w1"),
            std::string::npos)
      << failed.message;
  EXPECT_EQ(store_->size(), 2u);  // both full-attention pages were written first
}

}  // namespace
}  // namespace kvtd::daemon
