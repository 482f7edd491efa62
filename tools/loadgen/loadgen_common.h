// loadgen_common.h - what kvtd-loadgen's modes share: options, progress bar, the pattern-filled
// cache view and one synchronous task.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "device_tensors.h"
#include "kv_pattern.h"
#include "kvtd/engine/engine_session.h"

namespace kvtd::loadgen {

using kvtd::engine::EngineSession;
using kvtd::proto::TaskKind;
using kvtd::proto::TensorKind;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string storage = "file", storage_phase = "both", key_prefix = "lg";
  std::uint32_t storage_blocks = 0, in_flight = 1;
  bool storage_host_blocks = false;  // storage-throughput: tasks on host-pool blocks (filled by swaps first)
  bool cold_read = false;  // storage-throughput: the page cache dropped before the read phase (root)
  std::vector<std::string> cache_groups;  // --cache-group specs (kvtd/proto/group_spec.h); empty: one shape
  std::string session = "loadgen";
  std::string mode = "verify";
  std::uint32_t ranks = 2, layers = 32, kv_heads = 8, block_size = 64, head_dim = 128;
  std::string dtype = "bfloat16";
  std::int64_t device_blocks = 128, host_blocks = 96;
  std::uint32_t iterations = 40, blocks_per_task = 8;
  std::uint32_t latency_samples = 20000;
  double ready_timeout_s = 30, task_timeout_s = 30, seconds = 3;
  std::uint64_t seed = 42;
  bool wait_enter = false;
  std::string device_tensors = "host";  // host | cuda
  bool no_completion_forecast = false;   // SessionOptions::completion_forecast off (an A/B of it)
  bool layerwise = false;                // throughput: swap-ins layer by layer (TaskRequest::layerwise)
  DeviceTensors* tensors = nullptr;     // set by main
};

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

class Progress {
 public:
  Progress(const char* what, std::uint64_t total) : what_(what), total_(total), tty_(isatty(STDERR_FILENO) != 0) {}
  void update(std::uint64_t done, const std::string& extra) {
    const auto now = Clock::now();
    if (done < total_ && now - last_ < std::chrono::milliseconds(tty_ ? 100 : 2000)) return;
    last_ = now;
    const int width = 30;
    const int filled = total_ ? static_cast<int>(width * done / total_) : width;
    std::string bar(static_cast<std::size_t>(filled), '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "%s%-10s [%s] %3d%% %s%s", tty_ ? "\r" : "", what_, bar.c_str(),
                 total_ ? static_cast<int>(100 * done / total_) : 100, extra.c_str(), tty_ ? "   " : "\n");
    if (tty_ && done >= total_) std::fputc('\n', stderr);
  }

 private:
  const char* what_;
  std::uint64_t total_;
  bool tty_;
  Clock::time_point last_{};
};

// The engine's view of its tensors: host memory to fill and check. With CUDA tensors these are
// mirrors: push() after writing them, pull() before reading.
struct Cache {
  EngineSession* s;
  const kvtd::proto::CacheGeometry* g;
  std::vector<std::int64_t> device_owner;  // pattern block held by each device block, -1 = garbage
  std::vector<std::int64_t> host_owner;
  DeviceTensors* t = nullptr;
  bool push() { return t->push(); }
  bool pull() { return t->pull(); }

  // f(rank, layer, slot, tensor, bytes per block) for every tensor of the session.
  template <typename F>
  void for_each_tensor(F&& f) {
    for_each_group_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb,
                              std::uint32_t) { f(r, l, k, base, bb); });
  }
  // The same, with the cache group the tensor belongs to (0 for a single-shape session).
  template <typename F>
  void for_each_group_tensor(F&& f) {
    const auto& gs = s->groups();
    for (std::uint32_t r = 0; r < g->num_ranks; ++r)
      for (std::uint32_t l = 0; l < g->num_layers; ++l)
        for (std::uint32_t k = 0; k < kvtd::proto::kTensorKinds; ++k) {
          const auto d = kvtd::proto::expected_tensor(*g, gs, r, l, k);
          if (d.bytes == 0) continue;
          const auto group = kvtd::proto::is_group_session(gs) ? kvtd::proto::group_slot(gs, l, k).group : 0;
          f(r, l, k, t->view(r, l, static_cast<TensorKind>(k)), d.bytes / static_cast<std::uint64_t>(d.shape[0]),
            static_cast<std::uint32_t>(group));
        }
  }
};

// One cache group's share of a task's block ids (kvtd/proto/group_slots.h); a single-shape
// session is one group.
struct BlockGroup {
  std::int64_t device_base = 0, device_blocks = 0, host_base = 0, host_blocks = 0;
  std::uint64_t block_bytes = 0;  // one block, every layer and tensor, per rank
};
std::vector<BlockGroup> block_groups(const EngineSession& s);

// Submits one swap and waits; prints why on failure. Checks every block was moved. `latency_ns`:
// submit to wait's return; `result` (optional): the merged result, for its ranks' times.
bool run_task(kvtd::engine::EngineSession& s, TaskKind kind, const std::vector<std::int32_t>& src,
              const std::vector<std::int32_t>& dst, double timeout_s, std::int64_t* latency_ns = nullptr,
              kvtd::engine::TaskResult* result = nullptr, bool layerwise = false);

}  // namespace kvtd::loadgen
