// The daemon's CUDA path across processes, in the stand-in build (-DKVTD_CUDA_SIM=ON) and in
// real CUDA builds on a GPU (skipped without one; the GPU's PCI address is queried instead of the
// stand-in's 0000:17:00.0): real `kvtd --device-backend cuda` processes open the engine's device
// tensors through the IPC handles (base plus offset), run every scatter mode, export per-layer
// events the engine opens, and open FastDeploy's tensors by name. Faults and delays injected
// through the stand-in are in cuda_faults_test.
#include <filesystem>
#include <fmt/format.h>

#include "cuda_daemon_fixture.h"

namespace kvtd {
namespace {
class FastDeployWorker {
 public:
  FastDeployWorker(std::string port, std::uint32_t ranks) : port_(std::move(port)) {
    signal_ = "/dev/shm/cache_ready_signal." + port_;
    std::ofstream(signal_, std::ios::binary).write(std::string(4 * ranks, '\0').data(), 4 * ranks);
  }
  ~FastDeployWorker() {
    for (const auto& n : names_) unlink(("/dev/shm/" + n).c_str());
    unlink(signal_.c_str());
  }
  void publish(const std::string& name, void* data) {
    FastDeployShmStruct s{};
    ASSERT_EQ(cudaIpcGetMemHandle(&s.memHandle, data), cudaSuccess);
    std::ofstream(std::string("/dev/shm/") + name, std::ios::binary).write(reinterpret_cast<const char*>(&s), sizeof s);
    names_.push_back(name);
  }
  void cache_ready(std::uint32_t rank) {
    std::fstream f(signal_, std::ios::binary | std::ios::in | std::ios::out);
    const std::int32_t one = 1;
    f.seekp(4 * rank);
    f.write(reinterpret_cast<const char*>(&one), 4);
  }
  bool ready(std::uint32_t rank) const {
    std::int32_t v = 0;
    std::ifstream f(signal_, std::ios::binary);
    f.seekg(4 * rank);
    f.read(reinterpret_cast<char*>(&v), 4);
    return v == 1;
  }
  const std::string& port() const { return port_; }

 private:
  std::string port_, signal_;
  std::vector<std::string> names_;
};

// A FastDeploy engine: its session publishes no tensor; its CUDA daemons run with FastDeploy's
// signal suffix (and `extra` flags).
class FastDeployCudaTest : public CudaDaemonTest {
 protected:
  void start_engine_and_daemons(const FastDeployWorker& worker, const std::string& mode,
                                std::vector<std::string> extra = {}) {
    ASSERT_NO_FATAL_FAILURE(create_engine());
    ASSERT_TRUE(engine_->publish().ok());  // no tensor registered: FastDeploy's names are used
    extra.insert(extra.end(), {"--engine_worker_queue_port", worker.port()});
    for (std::uint32_t r = 0; r < g_.num_ranks; ++r) daemons_.push_back(start_cuda_daemon(r, mode, 0, extra));
  }
  static std::string name_of(proto::TensorKind kind, std::uint32_t l, std::uint32_t r) {
    return fmt::format("{}{}_rank{}.device0", kind == proto::TensorKind::kKey ? "key_caches_" : "value_caches_", l, r);
  }
};

TEST_F(FastDeployCudaTest, TheDaemonOpensTheTensorsFastDeploysWorkerPublishedByName) {
  FastDeployWorker worker(fmt::format("kvtdsim{}", getpid()), g_.num_ranks);
  ASSERT_NO_FATAL_FAILURE(start_engine_and_daemons(worker, "batch"));
  // The daemons wait for FastDeploy's cache_ready_signal before opening any name.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(engine_->rank_alive(0) && (engine_->rank_ready_flags(0) & proto::kReadyCacheAttached));
  for (std::uint32_t r = 0; r < g_.num_ranks; ++r) {
    for (std::uint32_t l = 0; l < g_.num_layers; ++l)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
        const auto kind = static_cast<proto::TensorKind>(k);
        if (!g_.has_tensor(kind)) continue;
        void* p = nullptr;
        ASSERT_EQ(cudaMalloc(&p, tensor_bytes(l, k)), cudaSuccess);
        arenas_.push_back(p);
        dev_[{r, l, k}] = static_cast<std::byte*>(p);
        ASSERT_NO_FATAL_FAILURE(worker.publish(name_of(kind, l, r), p));
      }
    worker.cache_ready(r);
  }
  fill_cuda();
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  EXPECT_NE(test::read_file(log_path(0)).find("published by name"), std::string::npos);
  ASSERT_NO_FATAL_FAILURE(cuda_round_trip({1, 2, 3, 17, 9}, {4, 5, 6, 0, 11}, {20, 21, 22, 7, 30}));
}

// FastDeploy with a storage backend passes --create_cache_tensor: the transfer manager makes the
// cache (cache_transfer_manager.py _init_gpu_cache) and FastDeploy's worker maps it by name
// once cache_ready_signal says so (gpu_model_runner.py: share_external_data, which opens the
// handle with cudaIpcOpenMemHandle at offset 0).
TEST_F(FastDeployCudaTest, TheDaemonMakesTheCacheFastDeploysWorkerMapsWithCreateCacheTensor) {
  FastDeployWorker worker(fmt::format("kvtdsimc{}", getpid()), g_.num_ranks);
  ASSERT_NO_FATAL_FAILURE(start_engine_and_daemons(worker, "kernel", {"--create_cache_tensor"}));
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  std::vector<void*> opened;
  for (std::uint32_t r = 0; r < g_.num_ranks; ++r) {
    ASSERT_TRUE(test::eventually([&] { return worker.ready(r); }, std::chrono::seconds(10)));
    for (std::uint32_t l = 0; l < g_.num_layers; ++l)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
        const auto kind = static_cast<proto::TensorKind>(k);
        if (!g_.has_tensor(kind)) continue;
        FastDeployShmStruct st{};
        std::ifstream("/dev/shm/" + name_of(kind, l, r), std::ios::binary).read(reinterpret_cast<char*>(&st), sizeof st);
        void* p = nullptr;
        ASSERT_EQ(cudaIpcOpenMemHandle(&p, st.memHandle, cudaIpcMemLazyEnablePeerAccess), cudaSuccess);
        opened.push_back(p);
        dev_[{r, l, k}] = static_cast<std::byte*>(p);
        std::vector<std::byte> zero(tensor_bytes(l, k)), got(zero.size(), std::byte{1});
        ASSERT_EQ(cudaMemcpy(got.data(), p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(got, zero) << "FastDeploy's cache starts zero-filled (paddle.full)";
      }
  }
  fill_cuda();
  EXPECT_NE(test::read_file(log_path(0)).find("published them by FastDeploy's names"), std::string::npos);
  ASSERT_NO_FATAL_FAILURE(cuda_round_trip({1, 2, 3, 17, 9}, {4, 5, 6, 0, 11}, {20, 21, 22, 7, 30}));
  for (void* p : opened) EXPECT_EQ(cudaIpcCloseMemHandle(p), cudaSuccess);
  dev_.clear();
  // The names this daemon published are its to remove when it stops: the test's teardown SIGKILLs
  // what still runs, which left all 12 in /dev/shm after every CI run.
  for (auto& d : daemons_) {
    d.signal(SIGTERM);
    ASSERT_EQ(d.wait_exit(std::chrono::seconds(30)), 0);
  }
  for (std::uint32_t r = 0; r < g_.num_ranks; ++r)
    for (std::uint32_t l = 0; l < g_.num_layers; ++l)
      for (const auto kind : {proto::TensorKind::kKey, proto::TensorKind::kValue})
        EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + name_of(kind, l, r))) << name_of(kind, l, r);
}

// Every scatter mode (two per test: a test keeps two daemon incarnations' logs). A run (1, 2, 3
// -> 4, 5, 6) and scattered blocks, out and back, byte for byte on every rank.
TEST_F(CudaDaemonTest, KernelModesMoveTheEnginesTensorsThroughIpcHandles) {
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  ASSERT_NO_FATAL_FAILURE(round_trip_in_modes({"kernel", "kernel-per-layer"}));
}

TEST_F(CudaDaemonTest, CopyEngineModesMoveTheEnginesTensorsThroughIpcHandles) {
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  ASSERT_NO_FATAL_FAILURE(round_trip_in_modes({"batch", "memcpy"}));
}

// Under CUDA_VISIBLE_DEVICES the engine's ordinal for a GPU is not the daemon's: the PCI address
// decides. The stand-in's device 0 is at 0000:17:00.0.
TEST_F(CudaDaemonTest, TheGpuIsMatchedByPciAddressNotByOrdinal) {
  g_ = test::small_geometry(1);
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine(/*device_id=*/5, device0_pci()));
  daemons_.push_back(start_cuda_daemon(0, "kernel", 0));
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  ASSERT_NO_FATAL_FAILURE(cuda_round_trip({1, 2}, {3, 4}, {5, 6}));
}

TEST_F(CudaDaemonTest, ATensorOnAnotherGpuIsRefusedNamingBothAddresses) {
  g_ = test::small_geometry(1);
  const std::uint32_t other = *proto::parse_pci_bus_id(device0_pci() == *proto::parse_pci_bus_id("0000:3b:00.0")
                                                           ? "0000:3c:00.0" : "0000:3b:00.0");
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine(/*device_id=*/0, other));
  daemons_.push_back(start_cuda_daemon(0, "kernel", 0));
  EXPECT_EQ(daemons_[0].wait_exit(std::chrono::seconds(30)), 5);
  const auto log = test::read_file(log_path(0));
  EXPECT_NE(log.find(proto::pci_bus_id_string(other)), std::string::npos) << log;
  EXPECT_NE(log.find(proto::pci_bus_id_string(device0_pci())), std::string::npos) << log;
}

TEST_F(CudaDaemonTest, LayerEventsOpenInTheEngineAndFireAfterTheirLayer) {
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  setenv("KVTD_CUDASIM_OP_DELAY_US", "3000", 1);  // slow streams: layers land one by one
  for (std::uint32_t r = 0; r < g_.num_ranks; ++r) daemons_.push_back(start_cuda_daemon(r, "kernel", 0));
  unsetenv("KVTD_CUDASIM_OP_DELAY_US");
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2, 9}, {3, 4, 5}).ok());
  ASSERT_NO_FATAL_FAILURE(scribble({1, 2, 9}));
  const auto id = submit(TaskKind::kSwapToDevice, {3, 4, 5}, {1, 2, 9}, /*layerwise=*/true);
  std::vector<cudaEvent_t> opened;
  for (std::uint32_t l = 0; l < g_.num_layers; ++l) {
    ASSERT_TRUE(engine_->wait_layer(id, l, 30'000'000'000, EngineSession::LayerStage::kEnqueued).ok());
    for (std::uint32_t r = 0; r < g_.num_ranks; ++r) {
      auto h = engine_->layer_event_handle(r, l);
      ASSERT_TRUE(h.has_value()) << "rank " << r << " published no event for layer " << l;
      cudaIpcEventHandle_t eh{};
      std::memcpy(&eh, h->data(), sizeof eh);
      cudaEvent_t ev{};
      ASSERT_EQ(cudaIpcOpenEventHandle(&ev, eh), cudaSuccess);
      opened.push_back(ev);
      // What the engine's compute stream would wait for: once the event fired, the layer is in.
      ASSERT_EQ(cudaEventSynchronize(ev), cudaSuccess);
      for (std::int32_t b : {1, 2, 9}) EXPECT_TRUE(holds(r, l, b, b)) << "rank " << r << " layer " << l;
    }
  }
  auto res = engine_->wait(id, 30'000'000'000);
  ASSERT_TRUE(res.ok() && res->ok());
  for (auto ev : opened) cudaEventDestroy(ev);
}

// Starts CUDA daemons over a file store at `store` (plus `flags`), stores blocks `src` under
// `keys`, scribbles over `dst` and loads the keys into it: every byte of every rank and layer
// checked. Returns the read request for reuse: its spans point at `keys` and `dst`.
class CudaStorageTest : public CudaDaemonTest {
 protected:
  TaskRequest store_then_load(const std::string& store, const std::vector<std::string>& flags,
                              const std::vector<std::string>& keys, const std::vector<std::int32_t>& src,
                              const std::vector<std::int32_t>& dst);
};

TaskRequest CudaStorageTest::store_then_load(const std::string& store, const std::vector<std::string>& flags,
                                             const std::vector<std::string>& keys,
                                             const std::vector<std::int32_t>& src,
                                             const std::vector<std::int32_t>& dst) {
  CudaStorageTest& t = *this;
  std::vector<std::string> extra = {"--storage-backend", "file", "--storage-path", store, "--model-id", "m1"};
  extra.insert(extra.end(), flags.begin(), flags.end());
  TaskRequest rd;
  rd.kind = TaskKind::kStorageRead;
  rd.keys = keys;
  rd.blocks = dst;
  for (std::uint32_t r = 0; r < t.g_.num_ranks; ++r) t.daemons_.push_back(t.start_cuda_daemon(r, "kernel", 0, extra));
  EXPECT_TRUE(t.engine_->wait_ready(30'000'000'000).ok()) << test::read_file(t.log_path(0));
  TaskRequest w;
  w.kind = TaskKind::kStorageWrite;
  w.keys = keys;
  w.blocks = src;
  auto wr = t.submit_and_wait(w);
  EXPECT_TRUE(wr.ok()) << (wr.failures.empty() ? "" : wr.failures[0].message);
  t.scribble(dst);
  auto got = t.submit_and_wait(rd);
  EXPECT_TRUE(got.ok()) << (got.failures.empty() ? "" : got.failures[0].message);
  EXPECT_EQ(got.blocks_done, keys.size());
  for (std::uint32_t r = 0; r < t.g_.num_ranks; ++r)
    for (std::uint32_t l = 0; l < t.g_.num_layers; ++l)
      for (std::size_t i = 0; i < dst.size(); ++i)
        EXPECT_TRUE(t.holds(r, l, dst[i], src[i])) << "rank " << r << " layer " << l << " block " << dst[i];
  return rd;
}

// A load from the file store reads each object straight into
// its slot of the worker's pinned staging, verifies it there and DMAs it from the slot. Every
// loaded byte is checked in device memory; an object corrupted on disk is a miss whose block keeps
// what it held (its slot is never copied to the device).
TEST_F(CudaStorageTest, StorageLoadsGoFromVerifiedPinnedStagingIntoDeviceBlocks) {
  const std::string store = ::testing::TempDir() + "/" + suffix_ + "_cuda_store";
  std::filesystem::remove_all(store);
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  // Named: the returned request's spans point at them.
  const std::vector<std::string> keys = {"c0", "c1", "c2", "c3"};
  const std::vector<std::int32_t> src = {1, 2, 17, 9}, dst = {20, 21, 22, 30};
  const TaskRequest rd = store_then_load(store, {}, keys, src, dst);
  ASSERT_FALSE(HasFailure());
  // Rank 0's object of c0 corrupted on disk: a miss there, so nothing loads (the MIN over ranks is
  // 0), and rank 0's block 20 still holds what it held, not the corrupt bytes.
  std::size_t corrupted = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(store)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file() || name.rfind("c0.w", 0) != 0 || name.find(".r0.kvo") == std::string::npos) continue;
    std::fstream io(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(100);
    io.put('\x42');
    ++corrupted;
  }
  ASSERT_EQ(corrupted, 1u);
  ASSERT_NO_FATAL_FAILURE(scribble({20}));
  auto bad = submit_and_wait(rd);
  ASSERT_TRUE(bad.ok()) << (bad.failures.empty() ? "" : bad.failures[0].message);
  EXPECT_EQ(bad.blocks_done, 0u);
  const std::uint64_t bb = g_.block_bytes(proto::TensorKind::kKey);
  std::vector<std::byte> v(bb);
  ASSERT_EQ(cudaMemcpy(v.data(), dev_[{0, 0, 0}] + 20 * bb, bb, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(v, std::vector<std::byte>(bb, std::byte{0xee})) << "a corrupt object reached the device";
  daemons_.clear();
  std::filesystem::remove_all(store);
}

// Objects by head (--storage-object-heads 1): each rank's block is one object per head, gathered
// from and scattered into its share of every device tensor's block through pinned staging.
TEST_F(CudaStorageTest, StorageObjectsByHeadMoveEachHeadsShareOfTheDeviceBlocks) {
  const std::string store = ::testing::TempDir() + "/" + suffix_ + "_cuda_heads";
  std::filesystem::remove_all(store);
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  store_then_load(store, {"--storage-object-heads", "1"}, {"h0", "h1", "h2"}, {3, 11, 5}, {25, 26, 27});
  std::size_t objects = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(store))
    objects += e.is_regular_file() && e.path().extension() == ".kvo";
  EXPECT_EQ(objects, 3u * g_.num_ranks * static_cast<std::size_t>(g_.key_shape[1])) << "one object per head";
  daemons_.clear();
  std::filesystem::remove_all(store);
}

}  // namespace
}  // namespace kvtd
