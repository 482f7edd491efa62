// cuda_daemon_fixture.h - the engine side of the CUDA daemon tests: this process owns the KV
// tensors as device memory (one allocation per rank, tensors at offsets in it, registered by
// the allocation's IPC handle plus offset) and starts real `kvtd --device-backend cuda` ranks.
// Used by cuda_daemon_test (stand-in and GPU) and cuda_faults_test (stand-in only).
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <tuple>

#include "cuda_runtime_api.h"
#include "daemon_fixture.h"
#include "kvtd/proto/pci.h"

namespace kvtd {
namespace {

// The PCI address of this process's device 0, packed (proto/pci.h).
inline std::uint32_t device0_pci() {
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


}  // namespace
}  // namespace kvtd
