// kvtd-loadgen: an engine stand-in built on the client library. It creates a session with a
// realistic geometry, fills the "device" tensors (host backend) with a pattern that encodes
// (rank, layer, tensor, block, offset), swaps random block sets out, overwrites the device
// blocks, swaps them back to other blocks and verifies every byte; it also measures task round
// trip latency and swap throughput against a plain memcpy of the same bytes.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvtd/ipc/clock.h"
#include "kvtd/proto/group_spec.h"
#include "loadgen_common.h"
#include "storage_modes.h"
#include "swap_modes.h"

namespace {

// Every flag of kvtd-loadgen into `o`.
void declare_flags(CLI::App& app, kvtd::loadgen::Options& o) {
  app.add_option("--session", o.session, "Session suffix (kvtd --session)");
  app.add_option("--mode", o.mode,
                 "verify | latency | throughput | all | storage-verify | storage-throughput | storage-latency")
      ->check(CLI::IsMember({"verify", "latency", "throughput", "all", "storage-verify", "storage-throughput",
                             "storage-latency"}));
  app.add_option("--storage", o.storage, "storage modes: the daemons' --storage-backend (file | redis), named in the output");
  app.add_option("--storage-phase", o.storage_phase,
                 "storage-verify: write | read | both (read: another engine process reads what a writer stored)");
  app.add_option("--key-prefix", o.key_prefix, "storage modes: prefix of the block keys");
  app.add_option("--storage-blocks", o.storage_blocks, "storage modes: blocks in all (verify: 32, throughput: 512)");
  app.add_option("--in-flight", o.in_flight, "storage-throughput: tasks in flight at once")->check(CLI::Range(1u, 64u));
  app.add_flag("--storage-host-blocks", o.storage_host_blocks,
               "storage-throughput: write from and read into host-pool blocks (filled by swaps first)");
  app.add_flag("--cold-read", o.cold_read,
               "storage-throughput: drop the page cache (/proc/sys/vm/drop_caches, root) before the read phase");
  app.add_option("--cache-group", o.cache_groups,
                 "One cache group, as the daemons' --cache-group (repeat per group; replaces --layers, --kv-heads, "
                 "--block-size, --head-dim, --dtype, --device-blocks and --host-blocks)")
      ->take_all();
  app.add_option("--ranks", o.ranks, "Tensor-parallel ranks (kvtd --mp-num)");
  app.add_option("--layers", o.layers, "Layers");
  app.add_option("--kv-heads", o.kv_heads, "KV heads per rank");
  app.add_option("--block-size", o.block_size, "Tokens per block");
  app.add_option("--head-dim", o.head_dim, "Head dimension");
  app.add_option("--dtype", o.dtype, "bfloat16 | float16 | uint8 | block_wise_fp8")
      ->check(CLI::IsMember({"bfloat16", "float16", "uint8", "block_wise_fp8"}));
  app.add_option("--device-blocks", o.device_blocks, "Device blocks per rank");
  app.add_option("--host-blocks", o.host_blocks, "Host blocks per rank (kvtd --num-host-blocks)");
  app.add_option("--iterations", o.iterations, "verify: swap-out/swap-in round trips");
  app.add_option("--blocks-per-task", o.blocks_per_task, "Blocks per task (verify, throughput)");
  app.add_option("--latency-samples", o.latency_samples, "latency: measured one-block tasks");
  app.add_option("--seconds", o.seconds, "throughput: measuring time");
  app.add_option("--ready-timeout", o.ready_timeout_s, "Seconds to wait for every rank");
  app.add_option("--task-timeout", o.task_timeout_s, "Seconds to wait for one task");
  app.add_option("--seed", o.seed, "Random seed");
  app.add_option("--device-tensors", o.device_tensors,
                 "Where the KV tensors live: host (shared memory; daemons --device-backend host) or cuda (cudaMalloc, "
                 "IPC handles; daemons --device-backend cuda)")
      ->check(CLI::IsMember({"host", "cuda"}));
  app.add_flag("--no-completion-forecast", o.no_completion_forecast,
               "Wait for swaps as before the completion forecast: poll 20 us, then sleep (a comparison)");
  app.add_flag("--layerwise", o.layerwise,
               "throughput: swap-ins layer by layer (each layer reported as it lands; a session of one shape)");
}

// The session the flags describe (K and V of one shape, or --cache-group's groups); "" or why not.
std::string session_options(const kvtd::loadgen::Options& o, kvtd::engine::SessionOptions* out) {
  kvtd::engine::SessionOptions& so = *out;
  so.suffix = o.session;
  so.completion_forecast = !o.no_completion_forecast;
  if (!o.cache_groups.empty()) {
    if (o.layerwise) return "--layerwise: a layer-by-layer swap-in needs a session of one shape (leave out --cache-group)";
    if (o.mode.rfind("storage", 0) == 0 && (o.storage_host_blocks || o.cold_read || o.storage_phase != "both"))
      return "--cache-group: the storage modes move device blocks in one engine process (leave out "
             "--storage-host-blocks, --cold-read and --storage-phase)";
    if (auto why = kvtd::proto::groups_from_specs(o.cache_groups, o.ranks, &so.groups); !why.empty())
      return "--cache-group: " + why;
    return "";
  }
  auto& g = so.geometry;
  g.num_ranks = o.ranks;
  g.num_layers = o.layers;
  g.dtype = static_cast<std::uint32_t>(o.dtype == "bfloat16"  ? kvtd::proto::CacheDtype::kBFloat16
                                       : o.dtype == "float16" ? kvtd::proto::CacheDtype::kFloat16
                                       : o.dtype == "uint8"   ? kvtd::proto::CacheDtype::kUInt8
                                                              : kvtd::proto::CacheDtype::kBlockWiseFp8);
  g.num_host_blocks = static_cast<std::uint32_t>(o.host_blocks);
  const std::int64_t shape[4] = {o.device_blocks, o.kv_heads, o.block_size, o.head_dim};
  for (int i = 0; i < 4; ++i) g.key_shape[i] = g.value_shape[i] = shape[i];
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvtd::loadgen;
  using kvtd::engine::EngineSession;
  Options o;
  CLI::App app{"kvtd-loadgen - engine stand-in: swaps KV blocks through kvtd and checks every byte"};
  declare_flags(app, o);
  CLI11_PARSE(app, argc, argv);
  for (const char* flag : {"--layers", "--kv-heads", "--block-size", "--head-dim", "--dtype", "--device-blocks",
                           "--host-blocks"})
    if (!o.cache_groups.empty() && app.count(flag) != 0) {
      std::fprintf(stderr, "kvtd-loadgen: --cache-group describes the whole cache; leave out %s\n", flag);
      return 2;
    }
  kvtd::engine::SessionOptions so;
  if (auto why = session_options(o, &so); !why.empty()) {
    std::fprintf(stderr, "kvtd-loadgen: %s\n", why.c_str());
    return 2;
  }
  auto created = EngineSession::create(so);
  if (!created.ok()) {
    std::fprintf(stderr, "kvtd-loadgen: %s\n", created.error().message.c_str());
    return 2;
  }
  auto& s = **created;
  const auto& g = s.geometry();
  std::string why;
  auto tensors = kvtd::loadgen::DeviceTensors::create(s, o.device_tensors == "cuda", &why);
  if (!tensors) {
    std::fprintf(stderr, "kvtd-loadgen: %s\n", why.c_str());
    return 2;
  }
  o.tensors = tensors.get();
  if (auto st = s.publish(); !st.ok()) {
    std::fprintf(stderr, "kvtd-loadgen: %s\n", st.error().message.c_str());
    return 2;
  }
  std::uint64_t block_bytes = 0;
  for (const auto& bg : block_groups(s)) block_bytes += bg.block_bytes;
  std::fprintf(stderr, "kvtd-loadgen: session %s published (%u ranks, %u layers, %zu cache group(s), %llu bytes per "
               "block per rank, every group); waiting for ranks\n",
               s.name().c_str(), g.num_ranks, g.num_layers, block_groups(s).size(),
               static_cast<unsigned long long>(block_bytes));
  if (auto st = s.wait_ready(static_cast<std::int64_t>(o.ready_timeout_s * 1e9)); !st.ok()) {
    std::fprintf(stderr, "kvtd-loadgen: %s\n", st.error().message.c_str());
    return 3;
  }
  int rc = 0;
  if (o.mode == "verify" || o.mode == "all") rc = rc ? rc : run_verify(s, o);
  if (o.mode == "latency" || o.mode == "all") rc = rc ? rc : run_latency(s, o);
  if (o.mode == "throughput" || o.mode == "all") rc = rc ? rc : run_throughput(s, o);
  const bool grouped = kvtd::proto::is_group_session(s.groups());
  if (o.mode == "storage-verify") rc = grouped ? run_group_storage_verify(s, o) : run_storage_verify(s, o);
  if (o.mode == "storage-throughput") rc = grouped ? run_group_storage_throughput(s, o) : run_storage_throughput(s, o);
  if (o.mode == "storage-latency") rc = run_storage_latency(s, o);
  return rc;
}
