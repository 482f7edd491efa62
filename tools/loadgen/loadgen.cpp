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
#include "loadgen_common.h"
#include "storage_modes.h"

namespace kvtd::loadgen {

bool run_task(EngineSession& s, TaskKind kind, const std::vector<std::int32_t>& src,
              const std::vector<std::int32_t>& dst, double timeout_s, std::int64_t* latency_ns,
              kvtd::engine::TaskResult* result) {
  kvtd::engine::TaskRequest req;
  req.kind = kind;
  req.src = src;
  req.dst = dst;
  const auto t0 = Clock::now();
  auto id = s.submit(req);
  if (!id.ok()) {
    std::fprintf(stderr, "\nsubmit failed: %s\n", id.error().message.c_str());
    return false;
  }
  auto r = s.wait(*id, static_cast<std::int64_t>(timeout_s * 1e9));
  if (latency_ns) *latency_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  if (result != nullptr && r.ok()) *result = *r;
  if (!r.ok()) {
    std::fprintf(stderr, "\nwait failed: %s\n", r.error().message.c_str());
    return false;
  }
  if (!r->ok()) {
    for (const auto& f : r->failures)
      std::fprintf(stderr, "\ntask %llu failed on rank %u: %s: %s\n", static_cast<unsigned long long>(r->task_id),
                   f.rank, kvtd::proto::task_status_name(f.status), f.message.c_str());
    return false;
  }
  if (r->blocks_done != src.size()) {
    std::fprintf(stderr, "\ntask reported %llu blocks, expected %zu\n", static_cast<unsigned long long>(r->blocks_done),
                 src.size());
    return false;
  }
  return true;
}

std::vector<std::int32_t> pick(std::mt19937_64& rng, const std::vector<std::int32_t>& pool, std::size_t n,
                               bool consecutive) {
  std::vector<std::int32_t> out;
  if (consecutive) {
    std::vector<std::int32_t> sorted = pool;
    std::sort(sorted.begin(), sorted.end());
    // a consecutive window if one exists, else fall back to random
    for (std::size_t tries = 0; tries < 16 && sorted.size() >= n; ++tries) {
      const std::size_t at = std::uniform_int_distribution<std::size_t>(0, sorted.size() - n)(rng);
      if (sorted[at + n - 1] - sorted[at] == static_cast<std::int32_t>(n - 1))
        return {sorted.begin() + static_cast<std::ptrdiff_t>(at), sorted.begin() + static_cast<std::ptrdiff_t>(at + n)};
    }
  }
  std::sample(pool.begin(), pool.end(), std::back_inserter(out), static_cast<std::ptrdiff_t>(n), rng);
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

int run_verify(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  Cache c{&s, &g, {}, {}, o.tensors};
  c.device_owner.resize(static_cast<std::size_t>(g.num_device_blocks()));
  std::iota(c.device_owner.begin(), c.device_owner.end(), 0);
  c.host_owner.assign(g.num_host_blocks, -1);
  c.for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
    for (std::int64_t b = 0; b < g.num_device_blocks(); ++b)
      kvtd::loadgen::fill_block(base + static_cast<std::uint64_t>(b) * bb, bb, r, l, k, static_cast<std::uint32_t>(b));
  });
  if (!c.push()) return 1;

  std::mt19937_64 rng(o.seed);
  std::vector<std::int32_t> all_host(g.num_host_blocks);
  std::iota(all_host.begin(), all_host.end(), 0);
  std::uint64_t verified = 0;
  Progress bar("verify", o.iterations);
  const auto t0 = Clock::now();
  for (std::uint32_t it = 0; it < o.iterations; ++it) {
    std::vector<std::int32_t> known, all_dev;
    for (std::int32_t b = 0; b < static_cast<std::int32_t>(c.device_owner.size()); ++b) {
      all_dev.push_back(b);
      if (c.device_owner[static_cast<std::size_t>(b)] >= 0) known.push_back(b);
    }
    const std::size_t n = std::min<std::size_t>({o.blocks_per_task, known.size(), all_host.size()});
    const bool runs = (it % 2) == 1;
    auto d = pick(rng, known, n, runs);
    auto h = pick(rng, all_host, n, runs);
    if (!run_task(s, TaskKind::kSwapToHost, d, h, o.task_timeout_s)) return 1;
    for (std::size_t i = 0; i < n; ++i)
      c.host_owner[static_cast<std::size_t>(h[i])] = c.device_owner[static_cast<std::size_t>(d[i])];
    // Overwrite the evicted device blocks, as the engine would reuse them.
    c.for_each_tensor([&](std::uint32_t, std::uint32_t, std::uint32_t, std::byte* base, std::uint64_t bb) {
      for (auto b : d) std::memset(base + static_cast<std::uint64_t>(b) * bb, 0xdd, bb);
    });
    if (!c.push()) return 1;
    for (auto b : d) c.device_owner[static_cast<std::size_t>(b)] = -1;
    auto d2 = pick(rng, all_dev, n, runs);
    if (!run_task(s, TaskKind::kSwapToDevice, h, d2, o.task_timeout_s)) return 1;
    for (std::size_t i = 0; i < n; ++i)
      c.device_owner[static_cast<std::size_t>(d2[i])] = c.host_owner[static_cast<std::size_t>(h[i])];
    bool bad = false;
    if (!c.pull()) return 1;
    c.for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
      for (auto b : d2) {
        const auto owner = static_cast<std::uint32_t>(c.device_owner[static_cast<std::size_t>(b)]);
        const auto off = kvtd::loadgen::check_block(base + static_cast<std::uint64_t>(b) * bb, bb, r, l, k, owner);
        if (off >= 0 && !bad) {
          std::fprintf(stderr, "\nMISMATCH rank %u layer %u %s device block %d (should hold block %u) at byte %lld\n",
                       r, l, kvtd::proto::tensor_kind_name(static_cast<TensorKind>(k)), b, owner,
                       static_cast<long long>(off));
          bad = true;
        }
        verified += bb;
      }
    });
    if (bad) return 1;
    bar.update(it + 1, std::to_string(2 * (it + 1)) + " tasks, " + std::to_string(verified >> 20) + " MiB verified");
  }
  std::printf("verify: %u round trips of %u blocks on %u ranks, %.1f MiB verified byte for byte in %.2f s: OK\n",
              o.iterations, o.blocks_per_task, g.num_ranks, static_cast<double>(verified) / (1 << 20), seconds_since(t0));
  return 0;
}

// Where a one-block round trip's time goes, per sample (ns, CLOCK_MONOTONIC on both sides):
// reaching a daemon (ring publish, the daemon's wake-up, decode, admission), executing (launch,
// copy, completion detection on the device, the report written), the engine noticing the report
// (its reads of the completion rings) and the waiting caller waking up.
struct RoundTripParts {
  std::vector<std::int64_t> to_start, execute, to_merge, to_caller;
};

void add_parts(RoundTripParts& parts, const kvtd::engine::TaskResult& r, std::int64_t returned_ns) {
  if (r.first_start_ns <= 0 || r.last_end_ns < r.first_start_ns || r.complete_ns < r.last_end_ns) return;
  parts.to_start.push_back(r.first_start_ns - r.submit_ns);
  parts.execute.push_back(r.last_end_ns - r.first_start_ns);
  parts.to_merge.push_back(r.complete_ns - r.last_end_ns);
  parts.to_caller.push_back(returned_ns - r.complete_ns);
}

void print_parts(const char* what, const RoundTripParts& p) {
  auto p50 = [](std::vector<std::int64_t> v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return static_cast<double>(v[v.size() / 2]) / 1000.0;
  };
  std::printf("%s breakdown (p50 of each part): submit -> daemon starts %.1f us (ring, wake-up, decode, "
              "admission) | execution %.1f us (launch, copy, device sync, report) | report -> engine merged %.1f us "
              "(completion detection) | merged -> caller returns %.1f us (waiter wake-up)\n",
              what, p50(p.to_start), p50(p.execute), p50(p.to_merge), p50(p.to_caller));
}

int run_latency(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  std::vector<std::int32_t> one{0}, one_h{0};
  std::vector<std::int64_t> samples;
  samples.reserve(o.latency_samples);
  RoundTripParts parts;
  const std::uint32_t warmup = std::min<std::uint32_t>(1000, o.latency_samples / 10 + 1);
  Progress bar("latency", o.latency_samples);
  for (std::uint32_t i = 0; i < warmup + o.latency_samples; ++i) {
    std::int64_t ns = 0;
    kvtd::engine::TaskResult r;
    if (!run_task(s, TaskKind::kSwapToHost, one, one_h, o.task_timeout_s, &ns, &r)) return 1;
    const std::int64_t returned = kvtd::ipc::monotonic_now_ns();
    if (i < warmup) continue;
    samples.push_back(ns);
    add_parts(parts, r, returned);
    bar.update(i - warmup + 1, "");
  }
  std::sort(samples.begin(), samples.end());
  auto q = [&](double p) { return static_cast<double>(samples[static_cast<std::size_t>(p * static_cast<double>(samples.size() - 1))]) / 1000.0; };
  std::printf("latency: one-block SWAP_TO_HOST (%llu bytes per rank) round trip, %u ranks, %zu samples: "
              "p50 %.1f us  p90 %.1f us  p99 %.1f us  max %.1f us\n",
              static_cast<unsigned long long>(g.bytes_per_block_all_layers()), g.num_ranks, samples.size(), q(0.5),
              q(0.9), q(0.99), q(1.0));
  print_parts("latency", parts);
  return 0;
}

int run_throughput(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  std::mt19937_64 rng(o.seed);
  std::vector<std::int32_t> all_dev(static_cast<std::size_t>(g.num_device_blocks())), all_host(g.num_host_blocks);
  std::iota(all_dev.begin(), all_dev.end(), 0);
  std::iota(all_host.begin(), all_host.end(), 0);
  const std::size_t n = std::min<std::size_t>({o.blocks_per_task, all_dev.size(), all_host.size()});
  const std::uint64_t bytes_per_task = g.bytes_per_block_all_layers() * n;  // per rank

  // A host block holds data only once something was swapped into it (the daemon fails a swap-in
  // of any other with host_tier_lost): fill the whole host tier once, unmeasured, so every
  // random swap-in below reads written blocks.
  for (std::size_t i = 0; i < all_host.size(); i += n) {
    const std::size_t m = std::min(n, all_host.size() - i);
    std::vector<std::int32_t> h(all_host.begin() + static_cast<std::ptrdiff_t>(i),
                                all_host.begin() + static_cast<std::ptrdiff_t>(i + m));
    std::vector<std::int32_t> d(all_dev.begin(), all_dev.begin() + static_cast<std::ptrdiff_t>(m));
    if (!run_task(s, TaskKind::kSwapToHost, d, h, o.task_timeout_s)) return 1;
  }

  // Rounds alternate swap tasks and a plain memcpy of the same number of bytes (in chunks of
  // one block of one tensor, between two buffers larger than the caches, in this process), so
  // both see the same machine state; the medians are compared.
  const std::uint64_t chunk = g.block_bytes(TensorKind::kKey);
  const std::uint64_t buf_bytes = std::max<std::uint64_t>(256ull << 20, chunk * 64);
  std::vector<std::byte> a(buf_bytes, std::byte{1}), b(buf_bytes, std::byte{2});
  const int rounds = 5;
  const auto round_time = std::chrono::duration<double>(o.seconds / rounds);
  std::vector<double> swap_rates, memcpy_rates;
  std::uint64_t tasks = 0;
  RoundTripParts parts;
  for (int round = 0; round < rounds; ++round) {
    std::uint64_t round_tasks = 0;
    double busy = 0;
    const auto t_end = Clock::now() + round_time;
    while (Clock::now() < t_end || round_tasks < 2) {
      auto d = pick(rng, all_dev, n, false);
      auto h = pick(rng, all_host, n, false);
      const bool in = (tasks % 2) != 0;
      const auto t0 = Clock::now();
      kvtd::engine::TaskResult r;
      if (!run_task(s, in ? TaskKind::kSwapToDevice : TaskKind::kSwapToHost, in ? h : d, in ? d : h, o.task_timeout_s,
                    nullptr, &r))
        return 1;
      busy += seconds_since(t0);
      add_parts(parts, r, kvtd::ipc::monotonic_now_ns());
      ++tasks;
      ++round_tasks;
    }
    swap_rates.push_back(static_cast<double>(bytes_per_task * round_tasks) / busy / 1e9);
    const std::uint64_t total = bytes_per_task * round_tasks;
    std::uint64_t copied = 0, off = 0;
    const auto t0 = Clock::now();
    while (copied < total) {
      if (off + chunk > buf_bytes) off = 0;
      std::memcpy(b.data() + off, a.data() + off, chunk);
      off += chunk;
      copied += chunk;
    }
    memcpy_rates.push_back(static_cast<double>(copied) / seconds_since(t0) / 1e9);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double swap_gbs = median(swap_rates), memcpy_gbs = median(memcpy_rates);
  std::printf("throughput: %zu random blocks per task, %llu-byte blocks x %u layers x %zu tensors, %u ranks, %llu tasks: "
              "swap %.2f GB/s per rank (%.2f GB/s all ranks), plain memcpy %.2f GB/s, ratio %.2f (medians of 5 rounds)\n",
              n, static_cast<unsigned long long>(chunk), g.num_layers,
              static_cast<std::size_t>(g.has_value() ? 2 : 1) + (g.has_scales() ? 2 : 0), g.num_ranks,
              static_cast<unsigned long long>(tasks), swap_gbs, swap_gbs * g.num_ranks, memcpy_gbs, swap_gbs / memcpy_gbs);
  print_parts("throughput", parts);
  return 0;
}

}  // namespace kvtd::loadgen

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
}

// The session the flags describe (K and V of one shape).
kvtd::engine::SessionOptions session_options(const kvtd::loadgen::Options& o) {
  kvtd::engine::SessionOptions so;
  so.suffix = o.session;
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

  return so;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvtd::loadgen;
  using kvtd::engine::EngineSession;
  Options o;
  CLI::App app{"kvtd-loadgen - engine stand-in: swaps KV blocks through kvtd and checks every byte"};
  declare_flags(app, o);
  CLI11_PARSE(app, argc, argv);
  const kvtd::engine::SessionOptions so = session_options(o);
  const auto& g = so.geometry;
  auto created = EngineSession::create(so);
  if (!created.ok()) {
    std::fprintf(stderr, "kvtd-loadgen: %s\n", created.error().message.c_str());
    return 2;
  }
  auto& s = **created;
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
  std::fprintf(stderr, "kvtd-loadgen: session %s published (%u ranks, %u layers, %llu bytes per block per rank); waiting for ranks\n",
               s.name().c_str(), g.num_ranks, g.num_layers, static_cast<unsigned long long>(g.bytes_per_block_all_layers()));
  if (auto st = s.wait_ready(static_cast<std::int64_t>(o.ready_timeout_s * 1e9)); !st.ok()) {
    std::fprintf(stderr, "kvtd-loadgen: %s\n", st.error().message.c_str());
    return 3;
  }
  int rc = 0;
  if (o.mode == "verify" || o.mode == "all") rc = rc ? rc : run_verify(s, o);
  if (o.mode == "latency" || o.mode == "all") rc = rc ? rc : run_latency(s, o);
  if (o.mode == "throughput" || o.mode == "all") rc = rc ? rc : run_throughput(s, o);
  if (o.mode == "storage-verify") rc = run_storage_verify(s, o);
  if (o.mode == "storage-throughput") rc = run_storage_throughput(s, o);
  if (o.mode == "storage-latency") rc = run_storage_latency(s, o);
  return rc;
}
