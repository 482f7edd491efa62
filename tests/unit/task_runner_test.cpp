// The task runner against an in-process engine and a scripted device backend, for behaviour the
// host backend cannot show (its copies finish the moment they are queued).
#include "kvtd/daemon/task_runner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "kvtd/ipc/engine_session.h"
#include "kvtd/ipc/rank_endpoint.h"
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
  Status<DeviceErrc> pin_host(std::byte*, std::size_t) override { return {}; }
  void unpin_host(std::byte*) override {}
  Status<DeviceErrc> copy(Direction, const kernels::CopyPlan&, std::span<const kernels::CopyTarget>) override { return {}; }
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
};

// The enqueued stage was published only together with the done stage, so an engine waiting to
// cudaStreamWaitEvent on layer l's event waited for the copy itself instead.
TEST(TaskRunner, LayerEnqueuedIsPublishedBeforeTheLayersCopyIsDone) {
  test::Watchdog dog(60);
  const auto g = test::small_geometry(1);
  const auto suffix = test::unique_suffix("enqueued");
  ipc::SessionOptions o;
  o.suffix = suffix;
  o.geometry = g;
  o.service_period_ns = 2'000'000;
  auto engine = ipc::EngineSession::create(o);
  ASSERT_TRUE(engine.ok()) << engine.error().message;
  ASSERT_TRUE((*engine)->create_host_device_tensors().ok());
  ASSERT_TRUE((*engine)->publish().ok());
  ipc::EndpointOptions eo;
  eo.suffix = suffix;
  eo.expected = g;
  eo.attach_timeout_ns = 5'000'000'000;
  auto ep = ipc::RankEndpoint::attach(eo);
  ASSERT_TRUE(ep.ok()) << ep.error().message;

  HeldCopiesBackend backend;
  std::vector<std::byte> dev(4096), host(4096);
  AttachedCache cache;
  cache.device_blocks = g.num_device_blocks();
  cache.host_blocks = g.num_host_blocks;
  cache.num_layers = g.num_layers;
  cache.block_bytes = {g.block_bytes(proto::TensorKind::kKey), g.block_bytes(proto::TensorKind::kValue)};
  for (std::uint32_t l = 0; l < g.num_layers; ++l)
    for (int k = 0; k < 2; ++k) {
      cache.to_host.push_back(kernels::CopyTarget{dev.data(), host.data(), cache.block_bytes[0]});
      cache.to_device.push_back(kernels::CopyTarget{host.data(), dev.data(), cache.block_bytes[0]});
    }
  TaskRunner runner(**ep, backend, std::move(cache));
  std::atomic<bool> stop{false};
  std::thread serve([&] { (void)runner.run(stop); });

  const std::vector<std::int32_t> src{1, 2}, dst{3, 4};
  ipc::TaskRequest req;
  req.kind = proto::TaskKind::kSwapToDevice;
  req.src = src;
  req.dst = dst;
  req.layerwise = true;
  auto id = (*engine)->submit(req);
  ASSERT_TRUE(id.ok()) << id.error().message;
  // Every layer is queued while no copy has finished.
  for (std::uint32_t l = 0; l < g.num_layers; ++l) {
    auto st = (*engine)->wait_layer(*id, l, 5'000'000'000, ipc::EngineSession::LayerStage::kEnqueued);
    EXPECT_TRUE(st.ok()) << "layer " << l << ": " << st.error().message;
  }
  auto not_done = (*engine)->wait_layer(*id, 0, 100'000'000, ipc::EngineSession::LayerStage::kDone);
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

}  // namespace
}  // namespace kvtd::daemon
