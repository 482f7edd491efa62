// The daemon's CUDA path across processes, in the stand-in build (-DKVTD_CUDA_SIM=ON) and in
// real CUDA builds on a GPU (skipped without one; the fault-injection case is stand-in only, and
// the GPU's PCI address is queried instead of the stand-in's 0000:17:00.0): this process is the engine and owns its KV tensors as device memory (cudaMalloc, one arena per
// rank, tensors at offsets in it); real `kvtd --device-backend cuda` processes open them through
// the IPC handles (base plus offset), run every scatter mode, export per-layer events the engine
// opens, and exit for a restart when the context is lost.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <map>
#include <tuple>

#include "cuda_runtime_api.h"
#include "daemon_fixture.h"
#include "kvtd/proto/pci.h"
#ifdef KVTD_CUDA_SIM
#include "kvtd/cudasim/control.h"
#endif

namespace kvtd {
namespace {

// The PCI address of this process's device 0, packed (proto/pci.h).
std::uint32_t device0_pci() {
  char bus[32] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, 0) != cudaSuccess) return 0;
  return proto::parse_pci_bus_id(bus).value_or(0);
}

class CudaDaemonTest : public DaemonTest {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no usable GPU";
    DaemonTest::SetUp();
  }

  std::vector<void*> arenas_;
  std::map<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>, std::byte*> dev_;

  ~CudaDaemonTest() override {
    daemons_.clear();
    engine_.reset();
    for (void* a : arenas_) cudaFree(a);
  }

  void create_engine() {
    engine::SessionOptions o;
    o.suffix = suffix_;
    o.geometry = g_;
    o.ring_bytes = 1u << 16;
    o.service_period_ns = 5'000'000;
    auto s = EngineSession::create(o);
    ASSERT_TRUE(s.ok()) << s.error().message;
    engine_ = std::move(s).value();
  }

  // device_id: the ordinal in this (engine) process; pci: the GPU's PCI address (0: none).
  void start_cuda_engine(std::int32_t device_id = 0, std::uint32_t pci = 0) {
    ASSERT_NO_FATAL_FAILURE(create_engine());
    for (std::uint32_t r = 0; r < g_.num_ranks; ++r) {
      // A caching allocator's picture: one allocation per rank, tensors inside it at offsets
      // (the first one not at 0), registered as the allocation's handle plus the offset.
      std::uint64_t total = 512;
      for (std::uint32_t l = 0; l < g_.num_layers; ++l)
        for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k)
          if (g_.has_tensor(static_cast<proto::TensorKind>(k)))
            total += (tensor_bytes(l, k) + 255) / 256 * 256;
      void* arena = nullptr;
      ASSERT_EQ(cudaMalloc(&arena, total), cudaSuccess);
      arenas_.push_back(arena);
      cudaIpcMemHandle_t h{};
      ASSERT_EQ(cudaIpcGetMemHandle(&h, arena), cudaSuccess);
      std::uint64_t offset = 512;
      for (std::uint32_t l = 0; l < g_.num_layers; ++l)
        for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
          const auto kind = static_cast<proto::TensorKind>(k);
          if (!g_.has_tensor(kind)) continue;
          proto::TensorDesc d = proto::describe_tensor(g_, r, l, kind);
          d.device_id = device_id;
          d.pci_bus_id = pci;
          d.offset = offset;
          std::memcpy(d.handle, &h, sizeof h);
          ASSERT_TRUE(engine_->register_tensor(d).ok());
          dev_[{r, l, k}] = static_cast<std::byte*>(arena) + offset;
          offset += (d.bytes + 255) / 256 * 256;
        }
    }
    fill_cuda();
    ASSERT_TRUE(engine_->publish().ok());
  }

  std::uint64_t tensor_bytes(std::uint32_t l, std::uint32_t k) const {
    return g_.block_bytes(static_cast<proto::TensorKind>(k)) * static_cast<std::uint64_t>(g_.device_blocks(l));
  }

  void fill_cuda() {
    for (auto& [key, p] : dev_) {
      auto [r, l, k] = key;
      const std::uint64_t bb = g_.block_bytes(static_cast<proto::TensorKind>(k));
      std::vector<std::byte> v(tensor_bytes(l, k));
      for (std::int64_t b = 0; b < g_.device_blocks(l); ++b)
        loadgen::fill_block(v.data() + static_cast<std::uint64_t>(b) * bb, bb, r, l, k, static_cast<std::uint32_t>(b));
      ASSERT_EQ(cudaMemcpy(p, v.data(), v.size(), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }

  // -1 when device block `blk` of every tensor of (rank, layer) holds the pattern of block `from`.
  bool holds(std::uint32_t r, std::uint32_t l, std::int32_t blk, std::int32_t from) {
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
      if (!g_.has_tensor(static_cast<proto::TensorKind>(k))) continue;
      const std::uint64_t bb = g_.block_bytes(static_cast<proto::TensorKind>(k));
      std::vector<std::byte> v(bb);
      EXPECT_EQ(cudaMemcpy(v.data(), dev_[{r, l, k}] + static_cast<std::uint64_t>(blk) * bb, bb, cudaMemcpyDeviceToHost),
                cudaSuccess);
      if (loadgen::check_block(v.data(), bb, r, l, k, static_cast<std::uint32_t>(from)) != -1) return false;
    }
    return true;
  }

  void scribble(const std::vector<std::int32_t>& blocks) {
    for (auto& [key, p] : dev_) {
      const std::uint64_t bb = g_.block_bytes(static_cast<proto::TensorKind>(std::get<2>(key)));
      std::vector<std::byte> junk(bb, std::byte{0xee});
      for (auto b : blocks)
        ASSERT_EQ(cudaMemcpy(p + static_cast<std::uint64_t>(b) * bb, junk.data(), bb, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }

  Child start_cuda_daemon(std::uint32_t rank, const std::string& mode, int incarnation,
                          const std::vector<std::string>& extra = {}) {
    auto args = daemon_args(rank, g_);
    for (std::size_t i = 0; i + 1 < args.size(); ++i)
      if (args[i] == "--device-backend") args[i + 1] = "cuda";
    args.insert(args.end(), {"--scatter-mode", mode, "--numa-node", "none"});
    args.insert(args.end(), extra.begin(), extra.end());
    return Child(args, log_path(rank, incarnation));
  }

  // Out to host, scribbled, back into other device blocks; every byte checked on every rank.
  void cuda_round_trip(const std::vector<std::int32_t>& dev, const std::vector<std::int32_t>& host,
                       const std::vector<std::int32_t>& dev2) {
    auto out = run(TaskKind::kSwapToHost, dev, host);
    ASSERT_TRUE(out.ok()) << (out.failures.empty() ? "" : out.failures[0].message);
    ASSERT_NO_FATAL_FAILURE(scribble(dev));
    auto in = run(TaskKind::kSwapToDevice, host, dev2);
    ASSERT_TRUE(in.ok()) << (in.failures.empty() ? "" : in.failures[0].message);
    for (std::uint32_t r = 0; r < g_.num_ranks; ++r)
      for (std::uint32_t l = 0; l < g_.num_layers; ++l)
        for (std::size_t i = 0; i < dev2.size(); ++i)
          ASSERT_TRUE(holds(r, l, dev2[i], dev[i])) << "rank " << r << " layer " << l << " block " << dev2[i];
    fill_cuda();
  }

  void round_trip_in_modes(std::initializer_list<const char*> modes) {
    int incarnation = 0;
    for (const char* mode : modes) {
      SCOPED_TRACE(mode);
      for (auto& d : daemons_) {  // the previous mode's daemons finish and leave in order
        d.signal(SIGTERM);
        ASSERT_EQ(d.wait_exit(std::chrono::seconds(30)), 0);
      }
      daemons_.clear();
      ASSERT_TRUE(test::eventually([&] { return !engine_->rank_alive(0) && !engine_->rank_alive(1); },
                                   std::chrono::seconds(10)));
      for (std::uint32_t r = 0; r < g_.num_ranks; ++r) daemons_.push_back(start_cuda_daemon(r, mode, incarnation));
      ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0, incarnation));
      ASSERT_NO_FATAL_FAILURE(cuda_round_trip({1, 2, 3, 17, 9}, {4, 5, 6, 0, 11}, {20, 21, 22, 7, 30}));
      ++incarnation;
    }
  }
};

// FastDeploy's GPU worker, as worker/gpu_model_runner.py initialize_kv_cache does it (upstream
// develop c1b7c083): one allocation per tensor (paddle.full), its handle published by set_data_ipc
// (custom_ops/gpu_ops/set_data_ipc.cu: cudaIpcGetMemHandle of the data pointer into a
// shared-memory `shmStruct { size_t nprocesses; cudaIpcMemHandle_t memHandle; }`,
// cuda_multiprocess.h) under key_caches_<layer>_rank<rank>.device<device> and value_caches_...,
// then cache_ready_signal.<port>[rank] = 1 (a numpy int32 IPCSignal). The engine registers nothing.
struct FastDeployShmStruct {
  std::size_t nprocesses;
  cudaIpcMemHandle_t memHandle;
};
static_assert(sizeof(FastDeployShmStruct) == 72);

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
    return (kind == proto::TensorKind::kKey ? "key_caches_" : "value_caches_") + std::to_string(l) + "_rank" +
           std::to_string(r) + ".device0";
  }
};

TEST_F(FastDeployCudaTest, TheDaemonOpensTheTensorsFastDeploysWorkerPublishedByName) {
  FastDeployWorker worker("kvtdsim" + std::to_string(getpid()), g_.num_ranks);
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
  FastDeployWorker worker("kvtdsimc" + std::to_string(getpid()), g_.num_ranks);
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

// Issue 20 item 1 on the CUDA path: a load from the file store reads each object straight into
// its slot of the worker's pinned staging, verifies it there and DMAs it from the slot. Every
// loaded byte is checked in device memory; an object corrupted on disk is a miss whose block keeps
// what it held (its slot is never copied to the device).
TEST_F(CudaDaemonTest, StorageLoadsGoFromVerifiedPinnedStagingIntoDeviceBlocks) {
  const std::string store = ::testing::TempDir() + "/" + suffix_ + "_cuda_store";
  std::filesystem::remove_all(store);
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  const std::vector<std::string> extra = {"--storage-backend", "file", "--storage-path", store, "--model-id", "m1"};
  for (std::uint32_t r = 0; r < g_.num_ranks; ++r) daemons_.push_back(start_cuda_daemon(r, "kernel", 0, extra));
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  const std::vector<std::string> keys = {"c0", "c1", "c2", "c3"};
  const std::vector<std::int32_t> src = {1, 2, 17, 9}, dst = {20, 21, 22, 30};
  TaskRequest w;
  w.kind = TaskKind::kStorageWrite;
  w.keys = keys;
  w.blocks = src;
  auto wr = submit_and_wait(w);
  ASSERT_TRUE(wr.ok()) << (wr.failures.empty() ? "" : wr.failures[0].message);
  ASSERT_NO_FATAL_FAILURE(scribble(dst));
  TaskRequest rd;
  rd.kind = TaskKind::kStorageRead;
  rd.keys = keys;
  rd.blocks = dst;
  auto got = submit_and_wait(rd);
  ASSERT_TRUE(got.ok()) << (got.failures.empty() ? "" : got.failures[0].message);
  EXPECT_EQ(got.blocks_done, 4u);
  for (std::uint32_t r = 0; r < g_.num_ranks; ++r)
    for (std::uint32_t l = 0; l < g_.num_layers; ++l)
      for (std::size_t i = 0; i < dst.size(); ++i)
        ASSERT_TRUE(holds(r, l, dst[i], src[i])) << "rank " << r << " layer " << l << " block " << dst[i];
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

#ifdef KVTD_CUDA_SIM  // faults are injected through the stand-in
TEST_F(CudaDaemonTest, StickyErrorFailsItsTaskAndTheDaemonExitsForARestart) {
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  daemons_.push_back(start_cuda_daemon(0, "kernel", 0));
  setenv("KVTD_CUDASIM_FAULTS", "cudaLaunchKernel:1:700", 1);  // rank 1's first kernel faults
  daemons_.push_back(start_cuda_daemon(1, "kernel", 0));
  unsetenv("KVTD_CUDASIM_FAULTS");
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2, 3}, {4, 5, 6}).ok());  // a run: no kernel
  const auto failed = run(TaskKind::kSwapToHost, {9, 17}, {0, 11});    // scattered: the kernel
  EXPECT_EQ(failed.status, TaskStatus::kDeviceError);
  ASSERT_FALSE(failed.failures.empty());
  EXPECT_EQ(failed.failures[0].rank, 1u);
  EXPECT_NE(failed.failures[0].message.find("cudaErrorIllegalAddress"), std::string::npos) << failed.failures[0].message;
  EXPECT_EQ(daemons_[1].wait_exit(std::chrono::seconds(30)), 7) << test::read_file(log_path(1));
  EXPECT_NE(test::read_file(log_path(1)).find("device context is lost"), std::string::npos);
  // systemd restarts it: the session goes on with a new context.
  daemons_[1] = start_cuda_daemon(1, "kernel", 1);
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(1, 1));
  cuda_round_trip({9, 17}, {0, 11}, {20, 21});
}


// The engine's stream still writes a block when it submits SWAP_TO_HOST of it (its kernels are
// queued, not done): the daemon's streams know nothing of the engine's, so the copy took the old
// bytes and reported ok (vllm#45704 is this bug class in-process). With the engine's
// interprocess event recorded after the write, the daemon's stream waits for it on the device.
// The stand-in delays the engine's stream by 300 ms so the write is certainly still queued.
TEST_F(CudaDaemonTest, ASwapToHostWaitsForTheEnginesEventAndOnlyThenSeesItsWrite) {
  g_ = test::small_geometry(1);
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  daemons_.push_back(start_cuda_daemon(0, "batch", 0));
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  cudaStream_t engine_stream{};
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine_stream, cudaStreamNonBlocking), cudaSuccess);
  cudasim::set_stream_delay_us(engine_stream, 300'000);
  std::vector<std::vector<std::byte>> sources;  // alive until the queued copies ran
  auto engine_writes = [&](std::int32_t block, std::byte value) {
    for (auto& [key, p] : dev_) {
      const std::uint64_t bb = g_.block_bytes(static_cast<proto::TensorKind>(std::get<2>(key)));
      sources.emplace_back(bb, value);
      ASSERT_EQ(cudaMemcpyAsync(p + static_cast<std::uint64_t>(block) * bb, sources.back().data(), bb,
                                cudaMemcpyHostToDevice, engine_stream),
                cudaSuccess);
    }
  };
  auto block_is = [&](std::int32_t block, std::byte value) {
    for (auto& [key, p] : dev_) {
      const std::uint64_t bb = g_.block_bytes(static_cast<proto::TensorKind>(std::get<2>(key)));
      std::vector<std::byte> got(bb);
      EXPECT_EQ(cudaMemcpy(got.data(), p + static_cast<std::uint64_t>(block) * bb, bb, cudaMemcpyDeviceToHost),
                cudaSuccess);
      if (std::count(got.begin(), got.end(), value) != static_cast<std::ptrdiff_t>(bb)) return false;
    }
    return true;
  };

  // Without the event: the copy ran before the queued write, and said ok.
  ASSERT_NO_FATAL_FAILURE(engine_writes(5, std::byte{0xAB}));
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {5}, {0}).ok());
  ASSERT_EQ(cudaStreamSynchronize(engine_stream), cudaSuccess);
  ASSERT_TRUE(run(TaskKind::kSwapToDevice, {0}, {9}).ok());
  for (std::uint32_t l = 0; l < g_.num_layers; ++l)
    EXPECT_TRUE(holds(0, l, 9, 5)) << "layer " << l << ": block 9 should hold block 5's old pattern (the hazard)";

  // With the event: the daemon's copy waits for the engine's write on the device.
  cudaEvent_t ev{};
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(engine_writes(6, std::byte{0xCD}));
  ASSERT_EQ(cudaEventRecord(ev, engine_stream), cudaSuccess);
  std::array<std::uint8_t, proto::kEngineEventBytes> handle{};
  cudaIpcEventHandle_t h{};
  ASSERT_EQ(cudaIpcGetEventHandle(&h, ev), cudaSuccess);
  std::memcpy(handle.data(), &h, sizeof h);
  TaskRequest req;
  req.kind = TaskKind::kSwapToHost;
  const std::vector<std::int32_t> src{6}, dst{1};
  req.src = src;
  req.dst = dst;
  req.engine_events = std::span(&handle, 1);
  auto out = submit_and_wait(req);
  ASSERT_TRUE(out.ok()) << (out.failures.empty() ? "" : out.failures[0].message);
  ASSERT_EQ(cudaStreamSynchronize(engine_stream), cudaSuccess);
  ASSERT_TRUE(run(TaskKind::kSwapToDevice, {1}, {10}).ok());
  EXPECT_TRUE(block_is(10, std::byte{0xCD})) << "the copy did not wait for the engine's write";
  // One event per rank, and only on swaps: anything else is refused at submit.
  std::array<std::array<std::uint8_t, proto::kEngineEventBytes>, 2> two{handle, handle};
  req.engine_events = std::span(two);
  EXPECT_EQ(engine_->submit(req).error().code, IpcErrc::kInvalidArgument);
  cudaEventDestroy(ev);
  cudaStreamDestroy(engine_stream);
}
#endif

}  // namespace
}  // namespace kvtd
