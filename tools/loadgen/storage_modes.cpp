#include "storage_modes.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fmt/format.h>
#include <numeric>

namespace kvtd::loadgen {

std::vector<std::string> block_keys(const std::string& prefix, std::size_t first, std::size_t n) {
  std::vector<std::string> k;
  for (std::size_t i = 0; i < n; ++i) k.push_back(fmt::format("{}-{}", prefix, first + i));
  return k;
}

std::optional<engine::TaskResult> storage_task(EngineSession& s, TaskKind kind, const std::vector<std::string>& keys,
                                            const std::vector<std::int32_t>& blocks, bool host, double timeout_s,
                                            std::uint32_t min_hits) {
  engine::TaskRequest req;
  req.kind = kind;
  req.keys = keys;
  req.blocks = blocks;
  req.host_blocks = host;
  req.min_hits = min_hits;
  req.submit_timeout_ns = static_cast<std::int64_t>(timeout_s * 1e9);
  auto id = s.submit(req);
  if (!id.ok()) {
    std::fprintf(stderr, "\n%s: submit failed: %s\n", proto::task_kind_name(kind), id.error().message.c_str());
    return std::nullopt;
  }
  auto r = s.wait(*id, static_cast<std::int64_t>(timeout_s * 1e9));
  if (!r.ok()) {
    std::fprintf(stderr, "\n%s: wait failed: %s\n", proto::task_kind_name(kind), r.error().message.c_str());
    return std::nullopt;
  }
  if (!r->ok()) {
    for (const auto& f : r->failures)
      std::fprintf(stderr, "\n%s failed on rank %u: %s: %s\n", proto::task_kind_name(kind), f.rank,
                   proto::task_status_name(f.status), f.message.c_str());
    return std::nullopt;
  }
  return *r;
}

namespace {

std::vector<std::int32_t> range_ids(std::int32_t first, std::size_t n) {
  std::vector<std::int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

// Checks that device blocks dst[i] hold the pattern of block orig[i] on every rank.
bool verify_device(Cache& c, const std::vector<std::int32_t>& dst, const std::vector<std::int32_t>& orig,
                   std::uint64_t* verified) {
  bool bad = !c.pull();
  c.for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
    for (std::size_t i = 0; i < dst.size() && !bad; ++i) {
      const auto off = check_block(base + static_cast<std::uint64_t>(dst[i]) * bb, bb, r, l, k,
                                   static_cast<std::uint32_t>(orig[i]));
      if (off >= 0) {
        std::fprintf(stderr, "\nMISMATCH rank %u layer %u %s device block %d (should hold block %d) at byte %lld\n", r,
                     l, proto::tensor_kind_name(static_cast<TensorKind>(k)), dst[i], orig[i], static_cast<long long>(off));
        bad = true;
      }
      *verified += bb;
    }
  });
  return !bad;
}

void fill_device(Cache& c) {
  c.for_each_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb) {
    for (std::int64_t b = 0; b < c.g->num_device_blocks(); ++b)
      fill_block(base + static_cast<std::uint64_t>(b) * bb, bb, r, l, k, static_cast<std::uint32_t>(b));
  });
  (void)c.push();  // a failure says why on stderr; the check that follows then fails
}

void wipe_device(Cache& c, const std::vector<std::int32_t>& ids) {
  c.for_each_tensor([&](std::uint32_t, std::uint32_t, std::uint32_t, std::byte* base, std::uint64_t bb) {
    for (auto b : ids) std::memset(base + static_cast<std::uint64_t>(b) * bb, 0xdd, bb);
  });
  (void)c.push();
}

}  // namespace

int run_storage_verify(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  Cache c{&s, &g, {}, {}, o.tensors};
  fill_device(c);
  const std::size_t n = o.storage_blocks != 0 ? o.storage_blocks
                                              : std::min<std::size_t>(32, static_cast<std::size_t>(g.num_device_blocks() / 2));
  if (2 * n > static_cast<std::size_t>(g.num_device_blocks())) {
    std::fprintf(stderr, "storage-verify: %zu blocks need %zu device blocks\n", n, 2 * n);
    return 2;
  }
  const auto keys = block_keys(o.key_prefix, 0, n);
  const auto orig = range_ids(0, n), dst = range_ids(static_cast<std::int32_t>(n), n);
  const bool host_path = g.num_host_blocks >= 2 * n;
  const double t = o.task_timeout_s;
  std::uint64_t verified = 0;
  const auto t0 = Clock::now();
  if (o.storage_phase != "read") {
    // Swap out, then back up from the host tier (or straight from the device without room).
    if (host_path && !run_task(s, TaskKind::kSwapToHost, orig, orig, t)) return 1;
    auto w = storage_task(s, TaskKind::kStorageWrite, keys, orig, host_path, t);
    if (!w) return 1;
    if (w->blocks_done + w->blocks_skipped != n) {
      std::fprintf(stderr, "storage-verify: write reported %llu written + %llu skipped of %zu\n",
                   static_cast<unsigned long long>(w->blocks_done), static_cast<unsigned long long>(w->blocks_skipped), n);
      return 1;
    }
    std::printf("storage-verify [%s]: wrote %llu blocks (%llu already stored) from %s blocks\n", o.storage.c_str(),
                static_cast<unsigned long long>(w->blocks_done), static_cast<unsigned long long>(w->blocks_skipped),
                host_path ? "host" : "device");
    wipe_device(c, orig);
  }
  if (o.storage_phase == "write") return 0;
  auto q = storage_task(s, TaskKind::kStorageQuery, keys, {}, false, t);
  if (!q) return 1;
  if (q->blocks_done != n) {
    std::fprintf(stderr, "storage-verify: query found %llu of %zu keys stored on every rank\n",
                 static_cast<unsigned long long>(q->blocks_done), n);
    return 1;
  }
  wipe_device(c, dst);
  auto rd = storage_task(s, TaskKind::kStorageRead, keys, dst, false, t);
  if (!rd) return 1;
  if (rd->blocks_done != n || !verify_device(c, dst, orig, &verified)) {
    std::fprintf(stderr, "storage-verify: read loaded %llu of %zu blocks\n", static_cast<unsigned long long>(rd->blocks_done), n);
    return 1;
  }
  if (host_path) {
    // Storage -> host pool (prefetch), then the usual swap-in.
    const auto host_dst = range_ids(static_cast<std::int32_t>(n), n);
    auto pf = storage_task(s, TaskKind::kPrefetch, keys, host_dst, true, t, static_cast<std::uint32_t>(n));
    if (!pf || pf->blocks_done != n) return 1;
    wipe_device(c, dst);
    if (!run_task(s, TaskKind::kSwapToDevice, host_dst, dst, t)) return 1;
    if (!verify_device(c, dst, orig, &verified)) return 1;
  }
  std::printf("storage-verify [%s]: query %zu/%zu hit, read%s back %zu blocks on %u ranks, %.1f MiB verified byte for "
              "byte in %.2f s: OK\n",
              o.storage.c_str(), n, n, host_path ? " and prefetch+swap-in" : "", n, g.num_ranks,
              static_cast<double>(verified) / (1 << 20), seconds_since(t0));
  return 0;
}

namespace {

// Swaps device blocks out into every host-pool block, so storage tasks on host blocks have data.
bool fill_host_pool(EngineSession& s, const proto::CacheGeometry& g, double timeout_s) {
  const auto n = static_cast<std::int32_t>(std::min<std::int64_t>(g.num_host_blocks, g.num_device_blocks()));
  for (std::int32_t first = 0; first < static_cast<std::int32_t>(g.num_host_blocks); first += n) {
    const std::int32_t m = std::min<std::int32_t>(n, static_cast<std::int32_t>(g.num_host_blocks) - first);
    std::vector<std::int32_t> dev(static_cast<std::size_t>(m)), host(static_cast<std::size_t>(m));
    for (std::int32_t i = 0; i < m; ++i) {
      dev[static_cast<std::size_t>(i)] = i;
      host[static_cast<std::size_t>(i)] = first + i;
    }
    engine::TaskRequest req;
    req.kind = TaskKind::kSwapToHost;
    req.src = dev;
    req.dst = host;
    req.submit_timeout_ns = static_cast<std::int64_t>(timeout_s * 1e9);
    auto id = s.submit(req);
    auto r = id.ok() ? s.wait(*id, static_cast<std::int64_t>(timeout_s * 1e9)) : std::move(id).error();
    if (!r.ok() || !r->ok()) {
      std::fprintf(stderr, "filling the host pool: %s\n", !r.ok() ? r.error().message.c_str() : r->failures[0].message.c_str());
      return false;
    }
  }
  return true;
}

}  // namespace

// Cold reads: the objects written are dropped from the page cache (after a sync, so every page
// is clean and goes), as after a restart or under memory pressure.
static bool drop_page_cache() {
  ::sync();
  FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w");
  if (f == nullptr || std::fputs("1\n", f) < 0 || std::fclose(f) != 0) {
    std::fprintf(stderr, "--cold-read: cannot write /proc/sys/vm/drop_caches (%s); it needs root\n", std::strerror(errno));
    return false;
  }
  return true;
}

int run_storage_throughput(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  Cache c{&s, &g, {}, {}, o.tensors};
  fill_device(c);
  const std::size_t per_task = std::min<std::size_t>(o.blocks_per_task, static_cast<std::size_t>(g.num_device_blocks()));
  const std::size_t total = o.storage_blocks != 0 ? o.storage_blocks : 512;
  // Fresh keys per run: a write of keys that are stored already is skipped, not measured.
  const std::string prefix =
      fmt::format("{}-{}-{}", o.key_prefix, ::getpid(), Clock::now().time_since_epoch().count() % 1000000007);
  const std::uint64_t object = g.bytes_per_block_all_layers();
  // Host-pool blocks: every one the tasks use holds data first (a swap-out of device blocks).
  const bool host = o.storage_host_blocks;
  const auto pool_blocks = static_cast<std::size_t>(host ? g.num_host_blocks : g.num_device_blocks());
  if (host && !fill_host_pool(s, g, o.task_timeout_s)) return 1;
  // Up to --in-flight tasks at a time, like an engine serving several requests.
  auto phase = [&](TaskKind kind, double* secs) -> bool {
    ::sync();  // like kvtd-storage-bench: each timed phase starts with no dirty pages left over
    const auto t0 = Clock::now();
    std::deque<std::pair<std::uint64_t, std::size_t>> inflight;  // task id, blocks
    auto collect = [&]() -> bool {
      auto [id, m] = inflight.front();
      inflight.pop_front();
      auto r = s.wait(id, static_cast<std::int64_t>(o.task_timeout_s * 1e9));
      if (!r.ok() || !r->ok() || r->blocks_done != m) {
        std::fprintf(stderr, "%s: %s\n", proto::task_kind_name(kind),
                     !r.ok() ? r.error().message.c_str()
                             : (!r->ok() ? r->failures[0].message.c_str() : "moved fewer blocks than asked"));
        return false;
      }
      return true;
    };
    for (std::size_t done = 0; done < total; done += per_task) {
      const std::size_t m = std::min(per_task, total - done);
      std::vector<std::int32_t> ids(m);
      // Tasks in flight together use disjoint blocks, so they do not wait for each other.
      const std::size_t base = (done / per_task % o.in_flight) * per_task % pool_blocks;
      for (std::size_t i = 0; i < m; ++i) ids[i] = static_cast<std::int32_t>((base + i) % pool_blocks);
      const auto keys = block_keys(prefix, done, m);
      engine::TaskRequest req;
      req.kind = kind;
      req.keys = keys;
      req.blocks = ids;
      req.host_blocks = host;
      req.submit_timeout_ns = static_cast<std::int64_t>(o.task_timeout_s * 1e9);
      auto id = s.submit(req);
      if (!id.ok()) {
        std::fprintf(stderr, "submit: %s\n", id.error().message.c_str());
        return false;
      }
      inflight.emplace_back(*id, m);
      if (inflight.size() >= o.in_flight && !collect()) return false;
    }
    while (!inflight.empty())
      if (!collect()) return false;
    *secs = seconds_since(t0);
    return true;
  };
  double write_s = 0, read_s = 0;
  if (!phase(TaskKind::kStorageWrite, &write_s)) return 1;
  if (o.cold_read && !drop_page_cache()) return 1;
  if (!phase(TaskKind::kStorageRead, &read_s)) return 1;
  const double bytes = static_cast<double>(object) * static_cast<double>(total);
  std::printf("storage-throughput [%s%s%s]: %zu objects of %llu bytes per rank in tasks of %zu (%u in flight), %u ranks: STORAGE_WRITE "
              "%.2f GB/s per rank (%.2f GB/s all ranks), STORAGE_READ %.2f GB/s per rank (%.2f GB/s all ranks)\n",
              o.storage.c_str(), host ? ", host blocks" : "", o.cold_read ? ", cold read" : "", total, static_cast<unsigned long long>(object), per_task, o.in_flight, g.num_ranks, bytes / write_s / 1e9,
              bytes * g.num_ranks / write_s / 1e9, bytes / read_s / 1e9, bytes * g.num_ranks / read_s / 1e9);
  return 0;
}

int run_storage_latency(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  const auto key = block_keys(o.key_prefix + "-lat", 0, 1);
  const auto blocks = proto::is_group_session(s.groups()) ? group_key_blocks(s, 1) : std::vector<std::int32_t>{0};
  if (!storage_task(s, TaskKind::kStorageWrite, key, blocks, false, o.task_timeout_s)) return 1;
  std::vector<std::int64_t> samples;
  const std::uint32_t warmup = std::min<std::uint32_t>(1000, o.latency_samples / 10 + 1);
  for (std::uint32_t i = 0; i < warmup + o.latency_samples; ++i) {
    const auto t0 = Clock::now();
    auto r = storage_task(s, TaskKind::kStorageQuery, key, {}, false, o.task_timeout_s);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    if (!r || r->blocks_done != 1) return 1;
    if (i >= warmup) samples.push_back(ns);
  }
  std::sort(samples.begin(), samples.end());
  auto q = [&](double p) {
    return static_cast<double>(samples[static_cast<std::size_t>(p * static_cast<double>(samples.size() - 1))]) / 1000.0;
  };
  std::printf("storage-latency [%s]: STORAGE_QUERY of one stored key (agreement across %u ranks), %zu samples: p50 %.1f us  "
              "p90 %.1f us  p99 %.1f us\n",
              o.storage.c_str(), g.num_ranks, samples.size(), q(0.5), q(0.9), q(0.99));
  return 0;
}

}  // namespace kvtd::loadgen
