// kvtd-loadgen's storage modes for a session of cache groups (--cache-group): each task names a
// block per key and group, group-major, -1 where a group has none (kvtd_client.h), as an engine
// of a hybrid model does: every block group's page of every key, and the state saved only at the
// last key of a task (a request's prefix end). A load takes only what each group's rule needs
// (kvtd/proto/group_hits.h), so the check and the byte count follow the same rule.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fmt/format.h>
#include <unistd.h>

#include "kvtd/proto/group_hits.h"
#include "storage_modes.h"

namespace kvtd::loadgen {
namespace {

// Per group: how many pages before a prefix's end a load takes (0: every page), and whether
// the group saves a state only at a task's last key.
struct GroupRule {
  std::uint32_t trailing = 0;
  bool state = false;
};

std::vector<GroupRule> rules_of(const proto::CacheGroups& gs) {
  std::vector<GroupRule> out;
  for (std::uint32_t g = 0; g < gs.num_groups; ++g)
    out.push_back({proto::trailing_pages(gs.groups[g], gs.page_tokens),
                   gs.groups[g].group_kind() == proto::GroupKind::kState});
  return out;
}

// The blocks of `n` keys, group-major in the task's id space: key i of a block group in its
// block first + i; a state group's only at the last key, in its block `state_at`.
std::vector<std::int32_t> task_blocks(const std::vector<BlockGroup>& bgs, const std::vector<GroupRule>& rules,
                                      std::size_t n, std::int64_t first, std::int64_t state_at) {
  std::vector<std::int32_t> out;
  for (std::size_t g = 0; g < bgs.size(); ++g)
    for (std::size_t i = 0; i < n; ++i)
      out.push_back(rules[g].state ? (i + 1 == n ? static_cast<std::int32_t>(bgs[g].device_base + state_at) : -1)
                                   : static_cast<std::int32_t>(bgs[g].device_base + first + static_cast<std::int64_t>(i)));
  return out;
}

// Whether a load of `n` keys takes key i of group g.
bool loads(const GroupRule& r, std::size_t i, std::size_t n) {
  if (r.state) return i + 1 == n;
  return r.trailing == 0 || i + r.trailing >= n;
}

}  // namespace

std::vector<std::int32_t> group_key_blocks(const EngineSession& s, std::size_t n) {
  return task_blocks(block_groups(s), rules_of(s.groups()), n, 0, 0);
}

int run_group_storage_verify(EngineSession& s, const Options& o) {
  const auto& g = s.geometry();
  const auto bgs = block_groups(s);
  const auto rules = rules_of(s.groups());
  Cache c{&s, &g, {}, {}, o.tensors};
  c.for_each_group_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb,
                              std::uint32_t grp) {
    for (std::int64_t b = 0; b < bgs[grp].device_blocks; ++b)
      fill_block(base + static_cast<std::uint64_t>(b) * bb, bb, r, l, k, static_cast<std::uint32_t>(b));
  });
  if (!c.push()) return 1;
  std::int64_t room = 32;  // keys: each block group stores from [0, n) and loads into [n, 2n)
  for (std::size_t i = 0; i < bgs.size(); ++i) {
    if (rules[i].state && bgs[i].device_blocks < 2) {
      std::fprintf(stderr, "storage-verify: cache group %zu (state) needs 2 slots: one stored from, one loaded into\n", i);
      return 2;
    }
    if (!rules[i].state) room = std::min(room, bgs[i].device_blocks / 2);
  }
  const auto n = static_cast<std::size_t>(o.storage_blocks != 0 ? o.storage_blocks : room);
  if (n == 0 || static_cast<std::int64_t>(n) > room) {
    std::fprintf(stderr, "storage-verify: %zu keys do not fit the groups' device blocks (at most %lld)\n", n,
                 static_cast<long long>(room));
    return 2;
  }
  const auto keys = block_keys(o.key_prefix, 0, n);
  const auto t0 = Clock::now();
  auto w = storage_task(s, TaskKind::kStorageWrite, keys, task_blocks(bgs, rules, n, 0, 0), false, o.task_timeout_s);
  if (!w || w->blocks_done + w->blocks_skipped != n) return 1;
  auto q = storage_task(s, TaskKind::kStorageQuery, keys, {}, false, o.task_timeout_s);
  if (!q || q->blocks_done != n) {
    std::fprintf(stderr, "storage-verify: query found %llu of %zu keys loadable on every rank\n",
                 q ? static_cast<unsigned long long>(q->blocks_done) : 0ull, n);
    return 1;
  }
  // Load into other blocks, wiped first: a block group's key i into n + i, a state into slot 1.
  c.for_each_group_tensor([&](std::uint32_t, std::uint32_t, std::uint32_t, std::byte* base, std::uint64_t bb,
                              std::uint32_t grp) {
    std::memset(base, 0xdd, static_cast<std::size_t>(bb * static_cast<std::uint64_t>(bgs[grp].device_blocks)));
  });
  if (!c.push()) return 1;
  constexpr std::int64_t state_into = 1;
  auto rd = storage_task(s, TaskKind::kStorageRead, keys,
                         task_blocks(bgs, rules, n, static_cast<std::int64_t>(n), state_into), false, o.task_timeout_s);
  if (!rd || rd->blocks_done != n || !c.pull()) return 1;
  std::uint64_t verified = 0;
  bool bad = false;
  c.for_each_group_tensor([&](std::uint32_t r, std::uint32_t l, std::uint32_t k, std::byte* base, std::uint64_t bb,
                              std::uint32_t grp) {
    for (std::size_t i = 0; i < n && !bad; ++i) {
      if (rules[grp].state && i + 1 != n) continue;
      const auto at = rules[grp].state ? state_into : static_cast<std::int64_t>(n + i);
      const std::byte* block = base + static_cast<std::uint64_t>(at) * bb;
      const bool want = loads(rules[grp], i, n);
      const auto off = want ? check_block(block, bb, r, l, k, rules[grp].state ? 0u : static_cast<std::uint32_t>(i))
                            : (block[0] == std::byte{0xdd} ? -1 : 0);
      if (off >= 0) {
        std::fprintf(stderr, "\nMISMATCH rank %u layer %u slot %u (group %u) key %zu %s at byte %lld\n", r, l, k, grp, i,
                     want ? "loaded wrong" : "loaded outside its group's rule", static_cast<long long>(off));
        bad = true;
      }
      verified += want ? bb : 0;
    }
  });
  if (bad) return 1;
  std::printf("storage-verify [%s, %zu cache groups]: wrote %zu keys (a page of every block group, the state at the "
              "last), query %zu/%zu, read back what each group's rule needs on %u ranks, %.1f MiB verified byte for "
              "byte in %.2f s: OK\n",
              o.storage.c_str(), bgs.size(), n, n, n, g.num_ranks, static_cast<double>(verified) / (1 << 20),
              seconds_since(t0));
  return 0;
}

int run_group_storage_throughput(EngineSession& s, const Options& o) {
  const auto bgs = block_groups(s);
  const auto rules = rules_of(s.groups());
  std::int64_t room = o.blocks_per_task;
  for (std::size_t i = 0; i < bgs.size(); ++i)
    if (!rules[i].state) room = std::min(room, bgs[i].device_blocks);
  const auto per_task = static_cast<std::size_t>(std::max<std::int64_t>(1, room));
  const std::size_t total = o.storage_blocks != 0 ? o.storage_blocks : 512;
  const std::string prefix =
      fmt::format("{}-{}-{}", o.key_prefix, ::getpid(), Clock::now().time_since_epoch().count() % 1000000007);
  std::uint64_t wrote = 0, read = 0;  // bytes per rank: every named block written; what the rules load
  auto phase = [&](TaskKind kind, double* secs, std::uint64_t* bytes) -> bool {
    ::sync();
    const auto t0 = Clock::now();
    for (std::size_t done = 0; done < total; done += per_task) {
      const std::size_t m = std::min(per_task, total - done);
      auto r = storage_task(s, kind, block_keys(prefix, done, m), task_blocks(bgs, rules, m, 0, 0), false,
                            o.task_timeout_s);
      if (!r || r->blocks_done != m) return false;
      for (std::size_t g = 0; g < bgs.size(); ++g)
        for (std::size_t i = 0; i < m; ++i)
          if (kind == TaskKind::kStorageWrite ? (!rules[g].state || i + 1 == m) : loads(rules[g], i, m))
            *bytes += bgs[g].block_bytes;
    }
    *secs = seconds_since(t0);
    return true;
  };
  double write_s = 0, read_s = 0;
  if (!phase(TaskKind::kStorageWrite, &write_s, &wrote) || !phase(TaskKind::kStorageRead, &read_s, &read)) return 1;
  const auto ranks = s.geometry().num_ranks;
  std::printf("storage-throughput [%s, %zu cache groups]: %zu keys per rank in tasks of %zu, %u ranks: STORAGE_WRITE "
              "%.2f GB/s per rank (%.1f MiB), STORAGE_READ %.2f GB/s per rank (%.1f MiB: what each group's rule loads)\n",
              o.storage.c_str(), bgs.size(), total, per_task, ranks, static_cast<double>(wrote) / write_s / 1e9,
              static_cast<double>(wrote) / (1 << 20), static_cast<double>(read) / read_s / 1e9,
              static_cast<double>(read) / (1 << 20));
  return 0;
}

}  // namespace kvtd::loadgen
