// The task runner against an in-process engine and a scripted device backend, for behaviour the
// host backend cannot show (its copies finish the moment they are queued).
#include "kvtd/daemon/task_runner.h"
#include "kvtd/daemon/host_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "kvtd/engine/engine_session.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/storage/file_store.h"
#include "endpoint_helpers.h"
#include "forwarding_file_system.h"
#include "test_support.h"

namespace kvtd::daemon {
namespace {

using namespace std::chrono_literals;

// Queues every layer at once (as the CUDA backend does: copies and an event per layer), then
// holds the copies "in flight" until the test releases them.
class HeldCopiesBackend final : public DeviceBackend {
 public:
  void release() {
    {
      std::lock_guard<std::mutex> g(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }
  const char* name() const override { return "held"; }
  Result<std::byte*, DeviceErrc> open_tensor(const proto::TensorDesc&) override {
    return make_error(DeviceErrc::kOpenFailed, "unused");
  }
  void close_tensors() override {}
  Result<std::byte*, DeviceErrc> alloc_host(std::size_t) override { return make_error(DeviceErrc::kAllocFailed, "unused"); }
  Result<ExportedTensor, DeviceErrc> create_exported(std::size_t, const std::string&) override {
    return make_error(DeviceErrc::kAllocFailed, "unused");
  }
  void free_exported() override {}
  void free_host(std::byte*) override {}
  Status<DeviceErrc> pin_host(std::byte*, std::size_t) override { return {}; }
  void unpin_host(std::byte*) override {}
  // copy(): at once, unless hold_copies() was called: then each copy waits until allow_copies()
  // let that many copies through in all.
  void hold_copies() {
    std::lock_guard<std::mutex> g(mu_);
    held_ = true;
  }
  void allow_copies(int total) {
    {
      std::lock_guard<std::mutex> g(mu_);
      allowed_ = total;
    }
    cv_.notify_all();
  }
  Status<DeviceErrc> copy(Direction, const kernels::CopyPlan&, std::span<const kernels::CopyTarget>) override {
    std::unique_lock<std::mutex> lk(mu_);
    if (!held_) return {};
    if (!cv_.wait_for(lk, 20s, [&] { return copies_ < allowed_; })) return make_error(DeviceErrc::kCopyFailed, "held");
    ++copies_;
    return {};
  }
  Status<DeviceErrc> copy_layerwise(Direction, const kernels::CopyPlan&, std::span<const kernels::CopyTarget> targets,
                                    std::size_t per_layer, const LayerCallback& on_enqueued,
                                    const LayerCallback& on_done) override {
    const auto layers = static_cast<std::uint32_t>(targets.size() / per_layer);
    for (std::uint32_t l = 0; l < layers; ++l) on_enqueued(l);
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (!cv_.wait_for(lk, 20s, [&] { return released_; }))
        return make_error(DeviceErrc::kCopyFailed, "never released");
    }
    for (std::uint32_t l = 0; l < layers; ++l) on_done(l);
    return {};
  }
  // --verify-swaps on a layer-by-layer load: every layer's checksums are `kept_sum(target)` but
  // those of layer `bad_layer`; handed over in order, then held until release().
  static std::uint64_t kept_sum(std::size_t target) { return 1000 + target; }
  std::uint32_t bad_layer = ~0u;
  Status<DeviceErrc> copy_layerwise_checked(Direction, const kernels::CopyPlan&,
                                            std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                            std::span<const std::int32_t> ids, const LayerCallback& on_enqueued,
                                            const CheckedLayer& on_checked) override {
    const auto layers = static_cast<std::uint32_t>(targets.size() / per_layer);
    for (std::uint32_t l = 0; l < layers; ++l) on_enqueued(l);
    for (std::uint32_t l = 0; l < layers; ++l) {
      std::vector<std::uint64_t> sums;
      for (std::size_t t = 0; t < per_layer; ++t)
        for (std::size_t k = 0; k < ids.size(); ++k) sums.push_back(l == bad_layer ? 7 : kept_sum(l * per_layer + t));
      on_checked(l, sums);
    }
    std::unique_lock<std::mutex> lk(mu_);
    if (!cv_.wait_for(lk, 20s, [&] { return released_; })) return make_error(DeviceErrc::kCopyFailed, "never released");
    return {};
  }
  Result<std::vector<std::array<std::uint8_t, proto::kHandleBytes>>, DeviceErrc> export_layer_events(std::uint32_t) override {
    return std::vector<std::array<std::uint8_t, proto::kHandleBytes>>{};
  }
  Status<DeviceErrc> gather_to_staging(std::span<const kernels::LayerTensor>, std::span<const std::int32_t>,
                                       std::byte*) override {
    return {};
  }
  Status<DeviceErrc> scatter_from_staging(std::span<const kernels::LayerTensor>, std::span<const std::int32_t>,
                                          const std::byte*) override {
    return {};
  }
  Result<std::byte*, DeviceErrc> alloc_device(std::size_t) override { return make_error(DeviceErrc::kAllocFailed, "unused"); }
  Status<DeviceErrc> write_device(std::byte*, const std::byte*, std::size_t) override { return {}; }
  Status<DeviceErrc> read_device(std::byte*, const std::byte*, std::size_t) override { return {}; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
  bool held_ = false;
  int allowed_ = 0, copies_ = 0;
};

// An engine (host-backend tensors) and the endpoint of its only rank, in this process.
struct OneRankSession {
  Result<std::unique_ptr<engine::EngineSession>, ipc::IpcErrc> engine = make_error(ipc::IpcErrc::kNotReady, "");
  Result<std::unique_ptr<endpoint::RankEndpoint>, ipc::IpcErrc> ep = make_error(ipc::IpcErrc::kNotReady, "");
  test::Heartbeats heartbeats;  // the daemon's serve loop: the grant outlives the rank timeout
  void start(const std::string& suffix, const proto::CacheGeometry& g, const proto::CacheGroups& groups = {}) {
    engine::SessionOptions o;
    o.suffix = suffix;
    o.geometry = g;
    o.groups = groups;
    if (proto::is_group_session(groups)) o.geometry = {};
    o.service_period_ns = 2'000'000;
    engine = engine::EngineSession::create(o);
    ASSERT_TRUE(engine.ok()) << engine.error().message;
    ASSERT_TRUE((*engine)->create_host_device_tensors().ok());
    ASSERT_TRUE((*engine)->publish().ok());
    endpoint::EndpointOptions eo;
    eo.suffix = suffix;
    eo.expected = g;
    eo.expected_groups = groups;
    eo.attach_timeout_ns = 5'000'000'000;
    ep = endpoint::RankEndpoint::attach(eo);
    ASSERT_TRUE(ep.ok()) << ep.error().message;
    heartbeats.watch(**ep);
  }
};

// The cache of `g` as one group whose every target copies between `dev` and `host` (the scripted
// backend moves no bytes), its host blocks' validity in `pool` when given.
AttachedCache one_group_cache(const proto::CacheGeometry& g, std::vector<std::byte>& dev, std::vector<std::byte>& host,
                              HostPool* pool = nullptr) {
  AttachedCache cache;
  cache.device_blocks = g.num_device_blocks();
  cache.host_blocks = g.num_host_blocks;
  GroupCache group;
  group.device_blocks = cache.device_blocks;
  group.host_blocks = cache.host_blocks;
  group.num_layers = g.num_layers;
  group.pool = pool;
  group.block_bytes = {g.block_bytes(proto::TensorKind::kKey), g.block_bytes(proto::TensorKind::kValue)};
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (int k = 0; k < 2; ++k) {
      group.to_host.push_back(kernels::packed_target(dev.data(), host.data(), group.block_bytes[0]));
      group.to_device.push_back(kernels::packed_target(host.data(), dev.data(), group.block_bytes[0]));
    }
  cache.groups.push_back(std::move(group));
  return cache;
}

// A SWAP_TO_DEVICE of host blocks `src` into device blocks `dst`, layer by layer.
Result<std::uint64_t, ipc::IpcErrc> submit_layerwise_load(engine::EngineSession& e, std::vector<std::int32_t> src,
                                                           std::vector<std::int32_t> dst) {
  engine::TaskRequest req;
  req.kind = proto::TaskKind::kSwapToDevice;
  req.src = src;
  req.dst = dst;
  req.layerwise = true;
  return e.submit(req);
}

// The enqueued stage was published only together with the done stage, so an engine waiting to
// cudaStreamWaitEvent on layer l's event waited for the copy itself instead.
TEST(TaskRunner, LayerEnqueuedIsPublishedBeforeTheLayersCopyIsDone) {
  test::Watchdog dog(60);
  const auto g = test::small_geometry(1);
  const auto suffix = test::unique_suffix("enqueued");
  OneRankSession session;
  ASSERT_NO_FATAL_FAILURE(session.start(suffix, g));
  auto& engine = session.engine;
  auto& ep = session.ep;

  HeldCopiesBackend backend;
  std::vector<std::byte> dev(4096), host(4096);
  TaskRunner runner(**ep, backend, one_group_cache(g, dev, host));
  std::atomic<bool> stop{false};
  std::thread serve([&] { (void)runner.run(stop); });

  auto id = submit_layerwise_load(**engine, {1, 2}, {3, 4});
  ASSERT_TRUE(id.ok()) << id.error().message;
  // Every layer is queued while no copy has finished.
  for (std::uint32_t l = 0; l < g.num_layers; ++l) {
    auto st = (*engine)->wait_layer(*id, l, 5'000'000'000, engine::EngineSession::LayerStage::kEnqueued);
    EXPECT_TRUE(st.ok()) << "layer " << l << ": " << st.error().message;
  }
  auto not_done = (*engine)->wait_layer(*id, 0, 100'000'000, engine::EngineSession::LayerStage::kDone);
  ASSERT_FALSE(not_done.ok());
  EXPECT_EQ(not_done.error().code, ipc::IpcErrc::kTimeout);
  backend.release();
  EXPECT_TRUE((*engine)->wait_layer(*id, g.num_layers - 1, 5'000'000'000).ok());
  auto r = (*engine)->wait(*id, 5'000'000'000);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->ok());
  stop = true;
  serve.join();
}


// --verify-swaps on a layer-by-layer load took every layer's checksums only after the last layer,
// by which time each layer had been reported done: an engine waiting for layer l on the host ran
// on it, changed bytes and all, before the task failed. Now a layer is reported done only once its
// checksums matched, and none after the first that differs; the task fails naming that layer.
TEST(TaskRunner, ALayerByLayerLoadReportsOnlyTheLayersWhoseChecksumsMatched) {
  test::Watchdog dog(60);
  const auto g = test::small_geometry(1);  // 3 layers x K/V
  const auto suffix = test::unique_suffix("checked");
  OneRankSession session;
  ASSERT_NO_FATAL_FAILURE(session.start(suffix, g));
  auto& engine = session.engine;
  auto& ep = session.ep;

  HeldCopiesBackend backend;
  backend.bad_layer = 1;
  auto pool = HostPool::open(backend, g, (*engine)->generation(), 0);
  ASSERT_TRUE(pool.ok()) << pool.error().message;
  const std::int32_t host_ids[2] = {1, 2};
  std::vector<std::uint64_t> kept;
  for (std::size_t t = 0; t < 2 * g.num_layers; ++t) kept.push_back(HeldCopiesBackend::kept_sum(t));
  for (const std::int32_t id : host_ids) (*pool)->set_checksums(id, kept);
  (*pool)->mark_valid(host_ids);
  std::vector<std::byte> dev(4096), host(4096);
  AttachedCache cache = one_group_cache(g, dev, host, pool->get());
  cache.verify_swaps = config::VerifySwaps::kFull;
  TaskRunner runner(**ep, backend, std::move(cache));
  std::atomic<bool> stop{false};
  std::thread serve([&] { (void)runner.run(stop); });

  auto id = submit_layerwise_load(**engine, {1, 2}, {3, 4});
  ASSERT_TRUE(id.ok()) << id.error().message;
  using Stage = engine::EngineSession::LayerStage;
  EXPECT_TRUE((*engine)->wait_layer(*id, 0, 5'000'000'000, Stage::kDone).ok()) << "layer 0 matched: reported";
  for (std::uint32_t l = 1; l < g.num_layers; ++l) {
    auto st = (*engine)->wait_layer(*id, l, 200'000'000, Stage::kDone);
    ASSERT_FALSE(st.ok()) << "layer " << l << " was reported done";
    EXPECT_EQ(st.error().code, ipc::IpcErrc::kTimeout) << st.error().message;
  }
  backend.release();
  auto r = (*engine)->wait(*id, 5'000'000'000);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, proto::TaskStatus::kIntegrity);
  ASSERT_FALSE(r->failures.empty());
  EXPECT_NE(r->failures[0].message.find("layer 1 "), std::string::npos) << r->failures[0].message;
  stop = true;
  serve.join();
  (*pool)->remove();
}

// A layer-by-layer load over several cache groups goes through the session's layers in order and
// reports layer l only once the copies of its tensors returned: here group 0 holds layers 0 and 2,
// group 1 layer 1, and each layer's one copy is let through one at a time.
TEST(TaskRunner, AGroupSessionsLayerIsReportedOnlyOnceItsCopyReturned) {
  test::Watchdog dog(60);
  proto::CacheGroups gs{};
  gs.num_ranks = 1;
  gs.num_groups = 2;
  gs.page_tokens = 4;
  for (std::uint32_t i = 0; i < 2; ++i) {
    auto& c = gs.groups[i];
    c.kind = static_cast<std::uint32_t>(i == 0 ? proto::GroupKind::kSlidingWindow : proto::GroupKind::kFullAttention);
    c.window_tokens = i == 0 ? 8 : 0;
    c.block_tokens = 4;
    c.num_tensors = 1;
    c.tensors[0] = {2, 2, {4, 8, 0}};
    c.device_blocks = 4;
    c.host_blocks = 4;
  }
  gs.groups[0].add_layer(0);
  gs.groups[0].add_layer(2);
  gs.groups[1].add_layer(1);
  const auto g = proto::envelope_of(gs);
  OneRankSession session;
  ASSERT_NO_FATAL_FAILURE(session.start(test::unique_suffix("glayers"), g, gs));
  auto& engine = session.engine;

  HeldCopiesBackend backend;
  backend.hold_copies();
  std::vector<std::byte> dev(4096), host(4096);
  AttachedCache cache;
  cache.group_session = true;
  cache.device_blocks = cache.host_blocks = 8;
  for (std::uint32_t i = 0; i < 2; ++i) {
    GroupCache group;
    group.device_blocks = group.host_blocks = 4;
    group.device_base = group.host_base = 4 * i;
    group.block_bytes = {64};
    group.layers = i == 0 ? std::vector<std::uint32_t>{0, 2} : std::vector<std::uint32_t>{1};
    group.num_layers = static_cast<std::uint32_t>(group.layers.size());
    for (std::size_t l = 0; l < group.layers.size(); ++l) {
      group.to_host.push_back(kernels::packed_target(dev.data(), host.data(), 64));
      group.to_device.push_back(kernels::packed_target(host.data(), dev.data(), 64));
    }
    cache.groups.push_back(std::move(group));
  }
  TaskRunner runner(**session.ep, backend, std::move(cache));
  std::atomic<bool> stop{false};
  std::thread serve([&] { (void)runner.run(stop); });

  auto id = submit_layerwise_load(**engine, {1, 5}, {2, 6});  // block 1 -> 2 of group 0, 1 -> 2 of group 1
  ASSERT_TRUE(id.ok()) << id.error().message;
  for (std::uint32_t layer = 0; layer < 3; ++layer) {
    auto early = (*engine)->wait_layer(*id, layer, 100'000'000);
    ASSERT_FALSE(early.ok()) << "layer " << layer << " reported before its copy returned";
    EXPECT_EQ(early.error().code, ipc::IpcErrc::kTimeout);
    backend.allow_copies(static_cast<int>(layer) + 1);
    auto st = (*engine)->wait_layer(*id, layer, 5'000'000'000);
    EXPECT_TRUE(st.ok()) << "layer " << layer << ": " << st.error().message;
  }
  auto r = (*engine)->wait(*id, 5'000'000'000);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->ok()) << (r->failures.empty() ? "" : r->failures[0].message);
  EXPECT_EQ(r->blocks_done, 2u);
  stop = true;
  serve.join();
}

// Fails every write_file after the first `ok_writes` with ENOSPC, leaving half a temporary
// file behind as a real full disk would.
class FillingFileSystem final : public test::ForwardingFileSystem {
 public:
  explicit FillingFileSystem(int ok_writes) : left_(ok_writes) {}
  int write_file(const std::string& p, std::span<const std::span<const std::byte>> parts, bool sync) override {
    if (left_.fetch_sub(1) <= 0) {
      const std::span<const std::byte> half[1] = {parts[0]};
      real->write_file(p, half, false);
      return ENOSPC;
    }
    return real->write_file(p, parts, sync);
  }
  // The store's sealed writes come through write_file above (the interface's default).
  int write_file_sealed(const std::string& p, std::span<const std::span<const std::byte>> parts, bool sync,
                        const Writing& on_write, const std::function<void()>& seal) override {
    return FileSystem::write_file_sealed(p, parts, sync, on_write, seal);
  }

 private:
  std::atomic<int> left_;
};

// ENOSPC through the FileSystem interface, in the daemon's own runner (no root needed): the
// write fails with storage_error naming it, no temporary file stays, and the objects written
// before it read back whole.
TEST(TaskRunner, StorageWriteRunningOutOfSpaceFailsAndLeavesWholeObjects) {
  test::Watchdog dog(60);
  const auto g = test::small_geometry(1);
  const auto suffix = test::unique_suffix("enospc");
  OneRankSession session;
  ASSERT_NO_FATAL_FAILURE(session.start(suffix, g));
  auto& engine = session.engine;
  auto& ep = session.ep;

  auto backend = make_host_backend();
  AttachedCache cache;
  cache.device_blocks = g.num_device_blocks();
  cache.host_blocks = g.num_host_blocks;
  cache.groups.resize(1);
  cache.groups[0].device_blocks = cache.device_blocks;
  cache.groups[0].host_blocks = cache.host_blocks;
  cache.groups[0].num_layers = g.num_layers;
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (auto kind : {proto::TensorKind::kKey, proto::TensorKind::kValue}) {
      auto dev = backend->open_tensor(*(*ep)->tensor(l, kind));
      ASSERT_TRUE(dev.ok()) << dev.error().message;
      cache.storage.device_tensors.push_back(kernels::LayerTensor{*dev, g.block_bytes(kind), g.block_bytes(kind)});
      // Each device block holds its block id in every byte, so what comes back can be checked.
      for (std::int64_t b = 0; b < g.num_device_blocks(); ++b)
        std::memset(*dev + b * g.block_bytes(kind), static_cast<int>(b), g.block_bytes(kind));
    }
  const std::string root = ::testing::TempDir() + "/" + suffix + "_store";
  std::filesystem::remove_all(root);
  FillingFileSystem fs(3);
  storage::FileStoreOptions fo;
  fo.store = {"m", layout_fingerprint(g, proto::ObjectSlicing{}, proto::KvIdentity{}), g.bytes_per_block_all_layers()};
  fo.root = root;
  fo.fs = &fs;
  fo.io_threads = 1;
  auto store = storage::open_file_store(fo);
  ASSERT_TRUE(store.ok()) << store.error().message;
  cache.storage.store = store->get();
  cache.storage.store_name = "file store " + root;
  cache.storage.object_bytes = g.bytes_per_block_all_layers();
  cache.storage.config.io_threads = 1;
  cache.storage.config.staging_mib = 1;
  TaskRunner runner(**ep, *backend, std::move(cache));
  std::atomic<bool> stop{false};
  std::thread serve([&] { (void)runner.run(stop); });

  auto submit = [&](proto::TaskKind kind, const std::vector<std::string>& keys, const std::vector<std::int32_t>& blocks) {
    engine::TaskRequest req;
    req.kind = kind;
    req.keys = keys;
    req.blocks = blocks;
    auto id = (*engine)->submit(req);
    EXPECT_TRUE(id.ok()) << id.error().message;
    auto r = (*engine)->wait(id.ok() ? *id : 0, 10'000'000'000);
    EXPECT_TRUE(r.ok());
    return r.ok() ? *r : engine::TaskResult{};
  };
  const std::vector<std::string> keys{"a", "b", "c", "d", "e"};
  auto w = submit(proto::TaskKind::kStorageWrite, keys, {1, 2, 3, 4, 5});
  EXPECT_EQ(w.status, proto::TaskStatus::kStorageError);
  ASSERT_FALSE(w.failures.empty());
  EXPECT_NE(w.failures[0].message.find("No space left on device"), std::string::npos) << w.failures[0].message;
  std::size_t temporaries = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root))
    if (e.is_regular_file() && e.path().filename().string().find(".tmp") != std::string::npos) ++temporaries;
  EXPECT_EQ(temporaries, 0u);
  auto q = submit(proto::TaskKind::kStorageQuery, keys, {});
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q.blocks_done, 3u);  // the three that fitted, whole
  auto rd = submit(proto::TaskKind::kStorageRead, keys, {20, 21, 22, 23, 24});
  ASSERT_TRUE(rd.ok());
  ASSERT_EQ(rd.blocks_done, 3u);
  auto* k0 = (*engine)->host_device_tensor(0, 0, proto::TensorKind::kKey);
  const auto bb = g.block_bytes(proto::TensorKind::kKey);
  for (int i = 0; i < 3; ++i)
    for (std::uint64_t off = 0; off < bb; ++off)
      ASSERT_EQ(k0[static_cast<std::uint64_t>(20 + i) * bb + off], static_cast<std::byte>(1 + i)) << i;
  stop = true;
  serve.join();
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace kvtd::daemon
