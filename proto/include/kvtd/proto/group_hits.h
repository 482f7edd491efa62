// kvtd/proto/group_hits.h - how much of a prefix can be loaded when its stored form is per cache
// group. Each group has its rule (sglang's PoolHitPolicy, sglang/srt/mem_cache/hicache_storage.py:83):
//
//   full attention, MLA latent, indexer  every page before the point (ALL_PAGES)
//   sliding window of W tokens           the ceil(W / page_tokens) pages before the point
//   state                                the state saved at the point: its last page (TRAILING_PAGES)
//
// The loadable prefix is the longest p at which *every* group's rule holds. sglang's file backend
// takes the minimum of each pool's own answer instead (hicache_storage.py:640-660), which can name
// a point where a trailing pool has no page: an ALL_PAGES pool stopping at 5 beside a state saved
// only at 10 gives 5, whose state is missing. kvtd never answers a point it cannot load.
//
// Pure functions: thread-safe, no allocation beyond the returned value's scratch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvtd/proto/cache_groups.h"

namespace kvtd::proto {

// The pages before a prefix's end that group `c` needs: 0 means every page.
constexpr std::uint32_t trailing_pages(const CacheGroup& c, std::uint32_t page_tokens) {
  switch (c.group_kind()) {
    case GroupKind::kSlidingWindow: return std::max<std::uint32_t>(1, (c.window_tokens + page_tokens - 1) / page_tokens);
    case GroupKind::kState: return 1;
    default: return 0;
  }
}

struct GroupHits {
  std::uint32_t pages = 0;                  // the loadable prefix, every group's rule holding
  std::uint32_t group_pages[kMaxGroups] = {};  // each group's own answer (metrics): leading run, or
                                            // the longest point its trailing rule allows
};

// The loadable prefix of `num_keys` keys, given `present(group, key)`: whether group `group`'s
// object of key `key` is stored (ids below num_groups and num_keys). `gs` passed geometry_problem.
template <typename Present>
GroupHits loadable_prefix(const CacheGroups& gs, std::uint32_t num_keys, Present&& present) {
  GroupHits out;
  std::uint32_t upper = num_keys;
  for (std::uint32_t g = 0; g < gs.num_groups; ++g) {
    if (trailing_pages(gs.groups[g], gs.page_tokens) != 0) continue;
    std::uint32_t run = 0;
    while (run < num_keys && present(g, run)) ++run;
    out.group_pages[g] = run;
    upper = std::min(upper, run);
  }
  // ok[p]: every trailing group holds the pages its rule needs before point p.
  std::vector<std::uint8_t> ok(upper + 1, 1);
  std::vector<std::uint32_t> run_before(upper + 1);  // present pages ending just before p
  for (std::uint32_t g = 0; g < gs.num_groups; ++g) {
    const std::uint32_t need = trailing_pages(gs.groups[g], gs.page_tokens);
    if (need == 0) continue;
    run_before[0] = 0;
    for (std::uint32_t p = 1; p <= upper; ++p) {
      run_before[p] = present(g, p - 1) ? run_before[p - 1] + 1 : 0;
      const bool holds = run_before[p] >= std::min(need, p);
      if (holds) out.group_pages[g] = p;
      ok[p] &= holds;
    }
  }
  for (std::uint32_t p = upper; p > 0; --p)
    if (ok[p]) {
      out.pages = p;
      break;
    }
  return out;
}

}  // namespace kvtd::proto
