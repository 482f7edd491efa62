// daemon_fixture.h - the engine side of multi-process tests: this process is the engine; every
// rank daemon is a real `kvtd` process (test::kvtd_binary(), programs.h) started under a watchdog.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "kv_pattern.h"
#include "kvtd/engine/engine_session.h"
#include "programs.h"
#include "test_support.h"

namespace kvtd {

using engine::EngineSession;
using ipc::IpcErrc;
using engine::TaskRequest;
using proto::TaskKind;
using proto::TaskStatus;
using test::Child;

std::string shape(const std::int64_t* s) {
  return fmt::format("{},{},{},{}", s[0], s[1], s[2], s[3]);
}

class DaemonTest : public ::testing::Test {
 protected:
  test::Watchdog dog_{90};
  std::string suffix_ = test::unique_suffix(::testing::UnitTest::GetInstance()->current_test_info()->name());
  proto::CacheGeometry g_ = test::small_geometry(2);
  std::unique_ptr<EngineSession> engine_;
  std::vector<Child> daemons_;

  void TearDown() override {
    daemons_.clear();
    engine_.reset();
    if (HasFailure()) return;  // keep the daemons' logs of a failed test for the reader
    for (std::uint32_t r = 0; r < 10; ++r)
      for (int i = 0; i < 2; ++i) std::remove(log_path(r, i).c_str());
  }

  std::string log_path(std::uint32_t rank, int incarnation = 0) const {
    return fmt::format("{}/{}_rank{}_{}.log", ::testing::TempDir(), suffix_, rank, incarnation);
  }

  std::vector<std::string> daemon_args(std::uint32_t rank, const proto::CacheGeometry& g) const {
    std::vector<std::string> a{test::kvtd_binary(), "--rank", std::to_string(rank), "--mp-num", std::to_string(g.num_ranks),
                               "--num-layers", std::to_string(g.num_layers - g.num_extra_layers), "--num-host-blocks",
                               std::to_string(g.num_host_blocks), "--key-cache-shape", shape(g.key_shape),
                               "--session", suffix_, "--device-backend", "host", "--engine-timeout", "1",
                               "--heartbeat-period", "0.02", "--log-level", "debug",
                               "--cache-dtype", proto::dtype_name(g.cache_dtype())};
    if (g.has_value()) {
      a.push_back("--value-cache-shape");
      a.push_back(shape(g.value_shape));
    }
    if (g.num_extra_layers != 0) {
      a.insert(a.end(), {"--num-extra-layers", std::to_string(g.num_extra_layers), "--extra-device-blocks",
                         std::to_string(g.extra_device_blocks)});
    }
    if (g.has_scales() && g.scale_element_bytes() == 4) a.insert(a.end(), {"--default-dtype", "float32"});
    a.insert(a.end(), extra_args_.begin(), extra_args_.end());
    return a;
  }

  Child start_daemon(std::uint32_t rank, int incarnation = 0) {
    return Child(daemon_args(rank, g_), log_path(rank, incarnation));
  }

  ipc::Fencer fencer_;  // empty: the real pidfd fence
  std::vector<std::string> extra_args_;  // appended to every daemon's flags

  // Replaces the geometry (K and V of the same shape, bf16) before the daemons start.
  void set_geometry(std::uint32_t layers, std::int64_t device_blocks, std::int64_t kv_heads, std::int64_t block_size,
                    std::int64_t head_dim, std::uint32_t host_blocks) {
    g_.num_layers = layers;
    g_.num_host_blocks = host_blocks;
    const std::int64_t shape[4] = {device_blocks, kv_heads, block_size, head_dim};
    for (int i = 0; i < 4; ++i) g_.key_shape[i] = g_.value_shape[i] = shape[i];
  }

  void start_engine(std::uint64_t ring_bytes = 1u << 16, std::int64_t rank_timeout_ns = 3'000'000'000) {
    engine::SessionOptions o;
    o.fencer = fencer_;
    o.suffix = suffix_;
    o.geometry = g_;
    o.ring_bytes = ring_bytes;
    o.rank_timeout_ns = rank_timeout_ns;
    o.service_period_ns = 5'000'000;
    auto s = EngineSession::create(o);
    ASSERT_TRUE(s.ok()) << s.error().message;
    engine_ = std::move(s).value();
    ASSERT_TRUE(engine_->create_host_device_tensors().ok());
    fill_device();
    ASSERT_TRUE(engine_->publish().ok());
  }

  void start_all(std::uint64_t ring_bytes = 1u << 16, std::int64_t rank_timeout_ns = 3'000'000'000) {
    for (std::uint32_t r = 0; r < g_.num_ranks; ++r) daemons_.push_back(start_daemon(r));
    ASSERT_NO_FATAL_FAILURE(start_engine(ring_bytes, rank_timeout_ns));
    auto st = engine_->wait_ready(20'000'000'000);
    ASSERT_TRUE(st.ok()) << st.error().message << "\n" << test::read_file(log_path(0));
  }

  template <typename F>
  void for_each_tensor(F&& f) {
    for (std::uint32_t r = 0; r < g_.num_ranks; ++r)
      for (std::uint32_t l = 0; l < g_.num_layers; ++l)
        for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
          const auto kind = static_cast<proto::TensorKind>(k);
          if (g_.has_tensor(kind)) f(r, l, k, engine_->host_device_tensor(r, l, kind), g_.block_bytes(kind));
        }
  }

  void fill_device() {
    for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
      for (std::int64_t b = 0; b < g_.device_blocks(l); ++b)
        loadgen::fill_block(base + static_cast<std::uint64_t>(b) * bb, bb, r, l, k, static_cast<std::uint32_t>(b));
    });
  }

  // Submits without waiting; the task id (0 after a failed assertion).
  std::uint64_t submit(TaskKind kind, const std::vector<std::int32_t>& src, const std::vector<std::int32_t>& dst,
                       bool layerwise = false) {
    TaskRequest req;
    req.kind = kind;
    req.src = src;
    req.dst = dst;
    req.layerwise = layerwise;
    auto id = engine_->submit(req);
    EXPECT_TRUE(id.ok()) << id.error().message;
    return id.ok() ? *id : 0;
  }

  // An eviction of `dev` into `host` and, submitted right behind it without waiting, a load of
  // `host` into `dev2`; both must complete ok.
  void evict_then_load(const std::vector<std::int32_t>& dev, const std::vector<std::int32_t>& host,
                       const std::vector<std::int32_t>& dev2) {
    const auto a = submit(TaskKind::kSwapToHost, dev, host);
    const auto b = submit(TaskKind::kSwapToDevice, host, dev2);
    for (auto id : {a, b}) {
      auto r = engine_->wait(id, 60'000'000'000);
      ASSERT_TRUE(r.ok()) << r.error().message;
      ASSERT_TRUE(r->ok()) << r->failures[0].message;
    }
  }

  // Submits and waits for the merged result (empty after a failed assertion).
  engine::TaskResult submit_and_wait(const TaskRequest& req) {
    auto id = engine_->submit(req);
    EXPECT_TRUE(id.ok()) << id.error().message;
    if (!id.ok()) return {};
    // A bound, not a timing: a 192 MiB swap under ThreadSanitizer takes tens of seconds.
    auto r = engine_->wait(*id, 60'000'000'000);
    EXPECT_TRUE(r.ok()) << r.error().message;
    return r.ok() ? *r : engine::TaskResult{};
  }

  engine::TaskResult run(TaskKind kind, const std::vector<std::int32_t>& src, const std::vector<std::int32_t>& dst) {
    TaskRequest req;
    req.kind = kind;
    req.src = src;
    req.dst = dst;
    return submit_and_wait(req);
  }

  // Swaps `dev` out to `host`, scribbles over them, swaps back into `dev2`, checks every byte.
  void round_trip(const std::vector<std::int32_t>& dev, const std::vector<std::int32_t>& host,
                  const std::vector<std::int32_t>& dev2) {
    std::vector<std::int32_t> owner(dev.size());
    auto out = run(TaskKind::kSwapToHost, dev, host);
    ASSERT_TRUE(out.ok()) << (out.failures.empty() ? "" : out.failures[0].message);
    EXPECT_EQ(out.blocks_done, dev.size());
    for_each_tensor([&](std::uint32_t, std::uint32_t, std::uint32_t, std::byte* base, std::uint64_t bb) {
      for (auto b : dev) std::memset(base + static_cast<std::uint64_t>(b) * bb, 0xee, bb);
    });
    auto in = run(TaskKind::kSwapToDevice, host, dev2);
    ASSERT_TRUE(in.ok()) << (in.failures.empty() ? "" : in.failures[0].message);
    for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
      for (std::size_t i = 0; i < dev2.size(); ++i) {
        const auto off = loadgen::check_block(base + static_cast<std::uint64_t>(dev2[i]) * bb, bb, r, l, k,
                                              static_cast<std::uint32_t>(dev[i]));
        ASSERT_EQ(off, -1) << "rank " << r << " layer " << l << " kind " << k << " block " << dev2[i];
      }
    });
    // The device blocks now hold the pattern of the swapped blocks; restore for later checks.
    fill_device();
  }
};

}  // namespace kvtd
