// kvtd-loadgen's swap modes (swap_modes.h). A task names blocks in the session's id space: a
// single shape's blocks, or every cache group's side by side (kvtd/proto/group_slots.h); each
// task below moves blocks of every group at once, as an engine of a hybrid model does.
#include "swap_modes.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvtd/ipc/clock.h"
#include "kvtd/proto/group_slots.h"
#include "kvtd/proto/session.h"

namespace kvtd::loadgen {

bool run_task(EngineSession& s, TaskKind kind, const std::vector<std::int32_t>& src,
              const std::vector<std::int32_t>& dst, double timeout_s, std::int64_t* latency_ns,
              kvtd::engine::TaskResult* result, bool layerwise) {
  kvtd::engine::TaskRequest req;
  req.kind = kind;
  req.src = src;
  req.dst = dst;
  req.layerwise = layerwise;
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

std::vector<BlockGroup> block_groups(const EngineSession& s) {
  const auto& gs = s.groups();
  const auto& g = s.geometry();
  if (!kvtd::proto::is_group_session(gs))
    return {BlockGroup{0, g.usable_device_blocks(), 0, g.num_host_blocks, g.bytes_per_block_all_layers()}};
  const auto ids = kvtd::proto::id_space(gs);
  const auto sizes = kvtd::proto::group_sizes(gs);
  std::vector<BlockGroup> out;
  for (std::uint32_t i = 0; i < gs.num_groups; ++i)
    out.push_back({ids.device_base[i], gs.groups[i].device_blocks, ids.host_base[i], gs.groups[i].host_blocks,
                   sizes.block_bytes[i]});
  return out;
}

namespace {

std::vector<std::int32_t> ids(std::int64_t first, std::int64_t count) {
  std::vector<std::int32_t> out(static_cast<std::size_t>(count));
  std::iota(out.begin(), out.end(), static_cast<std::int32_t>(first));
  return out;
}

// The device blocks' pattern owners (each group's own block ids; -1: overwritten) and groups.
struct VerifyState {
  Cache c;
  std::vector<BlockGroup> groups;
  std::vector<int> group_of_device;  // by the task's device id
  std::uint64_t verified = 0;
};

void fill_all(VerifyState& v) {
  auto& c = v.c;
  const auto& last = v.groups.back();
  c.device_owner.assign(static_cast<std::size_t>(last.device_base + last.device_blocks), -1);
  c.host_owner.assign(static_cast<std::size_t>(last.host_base + last.host_blocks), -1);
  v.group_of_device.assign(c.device_owner.size(), -1);
  for (std::size_t i = 0; i < v.groups.size(); ++i)
    for (std::int64_t b = 0; b < v.groups[i].device_blocks; ++b) {
      c.device_owner[static_cast<std::size_t>(v.groups[i].device_base + b)] = b;
      v.group_of_device[static_cast<std::size_t>(v.groups[i].device_base + b)] = static_cast<int>(i);
    }
  c.for_each_group_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb,
                              std::uint32_t grp) {
    for (std::int64_t b = 0; b < v.groups[grp].device_blocks; ++b)
      fill_block(base + static_cast<std::uint64_t>(b) * bb, bb, r, l, k, static_cast<std::uint32_t>(b));
  });
}

// One round trip's blocks: device blocks holding a pattern, host blocks, device blocks to load
// into; min(blocks per task, what the group has) of every group.
struct RoundTrip {
  std::vector<std::int32_t> out, host, in;
};

RoundTrip pick_round_trip(VerifyState& v, std::mt19937_64& rng, std::uint32_t per_group, bool runs) {
  RoundTrip t;
  for (const auto& bg : v.groups) {
    std::vector<std::int32_t> known;
    for (auto b : ids(bg.device_base, bg.device_blocks))
      if (v.c.device_owner[static_cast<std::size_t>(b)] >= 0) known.push_back(b);
    const std::size_t n = std::min<std::size_t>({per_group, known.size(), static_cast<std::size_t>(bg.host_blocks)});
    for (auto [to, from] : {std::pair{&t.out, known}, std::pair{&t.host, ids(bg.host_base, bg.host_blocks)},
                            std::pair{&t.in, ids(bg.device_base, bg.device_blocks)}}) {
      auto chosen = pick(rng, from, n, runs);
      to->insert(to->end(), chosen.begin(), chosen.end());
    }
  }
  return t;
}

// After the swap-in: every block of `in` holds the pattern of the block its owner names.
bool check_loaded(VerifyState& v, const std::vector<std::int32_t>& in) {
  bool bad = false;
  v.c.for_each_group_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb,
                                std::uint32_t grp) {
    for (auto b : in) {
      if (v.group_of_device[static_cast<std::size_t>(b)] != static_cast<int>(grp)) continue;
      const auto local = b - v.groups[grp].device_base;
      const auto owner = static_cast<std::uint32_t>(v.c.device_owner[static_cast<std::size_t>(b)]);
      const auto off = check_block(base + static_cast<std::uint64_t>(local) * bb, bb, r, l, k, owner);
      if (off >= 0 && !bad) {
        std::fprintf(stderr, "\nMISMATCH rank %u layer %u slot %u (group %u) device block %d (should hold block %u) at "
                             "byte %lld\n", r, l, k, grp, b, owner, static_cast<long long>(off));
        bad = true;
      }
      v.verified += bb;
    }
  });
  return !bad;
}

bool verify_round_trip(VerifyState& v, EngineSession& s, const Options& o, const RoundTrip& t) {
  auto& c = v.c;
  if (!run_task(s, TaskKind::kSwapToHost, t.out, t.host, o.task_timeout_s)) return false;
  for (std::size_t i = 0; i < t.out.size(); ++i)
    c.host_owner[static_cast<std::size_t>(t.host[i])] = c.device_owner[static_cast<std::size_t>(t.out[i])];
  // Overwrite the evicted device blocks, as the engine would reuse them.
  c.for_each_group_tensor([&](std::uint32_t, std::uint32_t, std::uint32_t, std::byte* base, std::uint64_t bb,
                              std::uint32_t grp) {
    for (auto b : t.out)
      if (v.group_of_device[static_cast<std::size_t>(b)] == static_cast<int>(grp))
        std::memset(base + static_cast<std::uint64_t>(b - v.groups[grp].device_base) * bb, 0xdd, bb);
  });
  if (!c.push()) return false;
  for (auto b : t.out) c.device_owner[static_cast<std::size_t>(b)] = -1;
  if (!run_task(s, TaskKind::kSwapToDevice, t.host, t.in, o.task_timeout_s)) return false;
  for (std::size_t i = 0; i < t.in.size(); ++i)
    c.device_owner[static_cast<std::size_t>(t.in[i])] = c.host_owner[static_cast<std::size_t>(t.host[i])];
  return c.pull() && check_loaded(v, t.in);
}

}  // namespace

int run_verify(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  VerifyState v{Cache{&s, &g, {}, {}, o.tensors}, block_groups(s), {}, 0};
  fill_all(v);
  if (!v.c.push()) return 1;
  std::mt19937_64 rng(o.seed);
  Progress bar("verify", o.iterations);
  const auto t0 = Clock::now();
  for (std::uint32_t it = 0; it < o.iterations; ++it) {
    if (!verify_round_trip(v, s, o, pick_round_trip(v, rng, o.blocks_per_task, (it % 2) == 1))) return 1;
    bar.update(it + 1, fmt::format("{} tasks, {} MiB verified", 2 * (it + 1), v.verified >> 20));
  }
  const std::string per = v.groups.size() > 1 && proto::is_group_session(s.groups())
                              ? fmt::format(" per cache group ({} groups in each task)", v.groups.size())
                              : "";
  std::printf("verify: %u round trips of %u blocks%s on %u ranks, %.1f MiB verified byte for byte in %.2f s: OK\n",
              o.iterations, o.blocks_per_task, per.c_str(), g.num_ranks, static_cast<double>(v.verified) / (1 << 20),
              seconds_since(t0));
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

// Where the waits of a run (since `before`) took their swaps' results relative to the completion
// forecast's poll window: in it, the report cost no wake-up.
void print_forecast_waits(const char* what, const EngineSession& s, const kvtd::engine::ForecastWaits& before) {
  const auto now = s.forecast_waits();
  const auto waits = now.waits - before.waits;
  if (waits == 0) {
    std::printf("%s completion forecast: no wait had one (--no-completion-forecast, or no lone swap)\n", what);
    return;
  }
  std::printf("%s completion forecast: %llu waits took the result before the poll window %llu, in it %llu, "
              "after it %llu\n",
              what, static_cast<unsigned long long>(waits),
              static_cast<unsigned long long>(now.before_window - before.before_window),
              static_cast<unsigned long long>(now.in_window - before.in_window),
              static_cast<unsigned long long>(now.after_window - before.after_window));
}

int run_latency(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  // Device block 0 of the first group out to its host blocks in turn (at most 8), so one task in
  // eight names a block --verify-swaps sampled checks, as in use; always host block 0 (which it
  // picks) made every sample pay the checksum.
  const BlockGroup first = block_groups(s).front();
  const std::int64_t host_span = std::max<std::int64_t>(1, std::min<std::int64_t>(8, first.host_blocks));
  std::vector<std::int32_t> one{static_cast<std::int32_t>(first.device_base)}, one_h{0};
  std::vector<std::int64_t> samples;
  samples.reserve(o.latency_samples);
  RoundTripParts parts;
  kvtd::engine::ForecastWaits waits_before;
  const std::uint32_t warmup = std::min<std::uint32_t>(1000, o.latency_samples / 10 + 1);
  Progress bar("latency", o.latency_samples);
  for (std::uint32_t i = 0; i < warmup + o.latency_samples; ++i) {
    std::int64_t ns = 0;
    kvtd::engine::TaskResult r;
    one_h[0] = static_cast<std::int32_t>(first.host_base + static_cast<std::int64_t>(i) % host_span);
    if (!run_task(s, TaskKind::kSwapToHost, one, one_h, o.task_timeout_s, &ns, &r)) return 1;
    const std::int64_t returned = kvtd::ipc::monotonic_now_ns();
    if (i + 1 == warmup) waits_before = s.forecast_waits();
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
  print_forecast_waits("latency", s, waits_before);
  return 0;
}

namespace {

// A throughput task's pairs: per_group[i] random pairs of group i.
struct TaskShape {
  std::vector<BlockGroup> groups;
  std::vector<std::size_t> per_group;
  std::uint64_t bytes = 0;  // per task, per rank
};

TaskShape task_shape(const EngineSession& s, std::uint32_t blocks_per_task) {
  TaskShape t{block_groups(s), {}, 0};
  for (const auto& bg : t.groups) {
    t.per_group.push_back(std::min<std::size_t>({blocks_per_task, static_cast<std::size_t>(bg.device_blocks),
                                                 static_cast<std::size_t>(bg.host_blocks)}));
    t.bytes += bg.block_bytes * t.per_group.back();
  }
  return t;
}

// A host block holds data only once something was swapped into it (the daemon fails a swap-in of
// any other with host_tier_lost): the whole host tier is filled once, unmeasured, so every random
// swap-in reads written blocks.
bool fill_host_tier(EngineSession& s, const TaskShape& t, double timeout_s) {
  for (std::size_t i = 0; i < t.groups.size(); ++i) {
    const auto& bg = t.groups[i];
    const auto n = static_cast<std::int64_t>(std::max<std::size_t>(1, t.per_group[i]));
    for (std::int64_t at = 0; at < bg.host_blocks; at += n) {
      const std::int64_t m = std::min(n, bg.host_blocks - at);
      if (!run_task(s, TaskKind::kSwapToHost, ids(bg.device_base, m), ids(bg.host_base + at, m), timeout_s)) return false;
    }
  }
  return true;
}

void pick_task(const TaskShape& t, std::mt19937_64& rng, std::vector<std::int32_t>* d, std::vector<std::int32_t>* h) {
  d->clear();
  h->clear();
  for (std::size_t i = 0; i < t.groups.size(); ++i) {
    auto dg = pick(rng, ids(t.groups[i].device_base, t.groups[i].device_blocks), t.per_group[i], false);
    auto hg = pick(rng, ids(t.groups[i].host_base, t.groups[i].host_blocks), t.per_group[i], false);
    d->insert(d->end(), dg.begin(), dg.end());
    h->insert(h->end(), hg.begin(), hg.end());
  }
}

std::string describe(const EngineSession& s, const TaskShape& t, std::uint64_t chunk) {
  const auto& g = s.geometry();
  if (!proto::is_group_session(s.groups()))
    return fmt::format("{} random blocks per task, {}-byte blocks x {} layers x {} tensors", t.per_group[0], chunk,
                       g.num_layers, (g.has_value() ? 2 : 1) + (g.has_scales() ? 2 : 0));
  std::string out = fmt::format("{} cache groups in each task, random blocks of each:", t.groups.size());
  for (std::size_t i = 0; i < t.groups.size(); ++i)
    out += fmt::format(" {} x {} B", t.per_group[i], t.groups[i].block_bytes);
  return fmt::format("{} ({} bytes per task per rank)", out, t.bytes);
}

// GB/s of a plain memcpy of `total` bytes in chunks of `chunk` between two buffers.
double memcpy_rate(std::vector<std::byte>& a, std::vector<std::byte>& b, std::uint64_t chunk, std::uint64_t total) {
  std::uint64_t copied = 0, off = 0;
  const auto t0 = Clock::now();
  while (copied < total) {
    if (off + chunk > a.size()) off = 0;
    std::memcpy(b.data() + off, a.data() + off, chunk);
    off += chunk;
    copied += chunk;
  }
  return static_cast<double>(copied) / seconds_since(t0) / 1e9;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int run_throughput(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  std::mt19937_64 rng(o.seed);
  const TaskShape shape = task_shape(s, o.blocks_per_task);
  if (!fill_host_tier(s, shape, o.task_timeout_s)) return 1;
  // Rounds alternate swap tasks and a plain memcpy of the same number of bytes (in chunks of one
  // block of one tensor, between two buffers larger than the caches, in this process), so both
  // see the same machine state; the medians are compared.
  std::uint64_t chunk = 0;
  Cache view{&s, &g, {}, {}, o.tensors};
  view.for_each_tensor([&](std::uint32_t, std::uint32_t, std::uint32_t, std::byte*, std::uint64_t bb) {
    if (chunk == 0) chunk = bb;  // one block of the first tensor
  });
  const std::uint64_t buf_bytes = std::max<std::uint64_t>(256ull << 20, chunk * 64);
  std::vector<std::byte> a(buf_bytes, std::byte{1}), b(buf_bytes, std::byte{2});
  const int rounds = 5;
  const auto round_time = std::chrono::duration<double>(o.seconds / rounds);
  std::vector<double> swap_rates, memcpy_rates;
  std::uint64_t tasks = 0;
  RoundTripParts parts;
  const kvtd::engine::ForecastWaits waits_before = s.forecast_waits();
  std::vector<std::int32_t> d, h;
  for (int round = 0; round < rounds; ++round) {
    std::uint64_t round_tasks = 0;
    double busy = 0;
    for (const auto t_end = Clock::now() + round_time; Clock::now() < t_end || round_tasks < 2; ++round_tasks, ++tasks) {
      pick_task(shape, rng, &d, &h);
      const bool in = (tasks % 2) != 0;
      const auto t0 = Clock::now();
      kvtd::engine::TaskResult r;
      if (!run_task(s, in ? TaskKind::kSwapToDevice : TaskKind::kSwapToHost, in ? h : d, in ? d : h, o.task_timeout_s,
                    nullptr, &r, in && o.layerwise))
        return 1;
      busy += seconds_since(t0);
      add_parts(parts, r, kvtd::ipc::monotonic_now_ns());
    }
    swap_rates.push_back(static_cast<double>(shape.bytes * round_tasks) / busy / 1e9);
    memcpy_rates.push_back(memcpy_rate(a, b, chunk, shape.bytes * round_tasks));
  }
  const double swap_gbs = median(swap_rates), memcpy_gbs = median(memcpy_rates);
  std::printf("throughput: %s%s, %u ranks, %llu tasks: swap %.2f GB/s per rank (%.2f GB/s all ranks), plain memcpy "
              "%.2f GB/s, ratio %.2f (medians of 5 rounds)\n",
              describe(s, shape, chunk).c_str(), o.layerwise ? ", swap-ins layer by layer" : "", g.num_ranks, static_cast<unsigned long long>(tasks), swap_gbs,
              swap_gbs * g.num_ranks, memcpy_gbs, swap_gbs / memcpy_gbs);
  print_parts("throughput", parts);
  print_forecast_waits("throughput", s, waits_before);
  return 0;
}

}  // namespace kvtd::loadgen
