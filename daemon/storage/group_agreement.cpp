// Phase 1 of a storage task of a session whose cache is cache groups, on the agreement thread:
// every (key, group) object asked of its group's store, this rank's answer by the groups' rules,
// the MIN across ranks, and the objects phase 2 then moves.
//
// A task names, per key, one block of each group (-1: none). A load takes what each group's rule
// needs at the agreed point p and nothing else (kvtd/proto/group_hits.h: every page before p of
// a full-attention, MLA or indexer group; the window's pages before p of a sliding-window group;
// the state saved at p of a state group). A group's page is loadable only where the task names a
// block for it and its object is stored. A load that names no block of a group at any key leaves
// that group out: it loads the other groups by their rules alone (sglang loads a hybrid model's
// KV pool, then each state or window pool for the keys it chose, as separate calls).
//
// The ranks agree on the MIN of their loadable prefixes in one round. Each rank's answer is a
// point where its every rule holds, but a trailing rule (window, state) need not hold on a rank
// at a smaller point: such a rank loads nothing and answers 0 blocks, so the engine's merged
// answer is 0. That happens only when the ranks' stores differ (a write that failed or an
// object evicted on one rank): a lost hit, never a wrong byte.
#include <algorithm>
#include <fmt/format.h>

#include "executor_impl.h"
#include "kvtd/daemon/log.h"
#include "kvtd/daemon/status_of.h"
#include "kvtd/proto/group_hits.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::daemon {

namespace {

// Group `g`'s own block id of key `k` (an index into the record's keys) in `w`, or -1.
std::int32_t group_block(const StorageTargets& t, const StorageWork& w, std::uint32_t g, std::size_t k) {
  if (w.blocks.empty()) return -1;  // a STORAGE_QUERY names no blocks
  const std::int32_t id = w.blocks[g * w.section.keys.size() + k];
  if (id < 0) return -1;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  return static_cast<std::int32_t>(id - (host ? t.groups[g].host_base : t.groups[g].device_base));
}

}  // namespace

// Which groups take part in the task: for a load, those it names a block for at some key (an
// engine loading one group at a time, as sglang's hybrid controller loads the KV pool and then
// each state or window pool: the groups it leaves out are neither loaded nor asked to hold their
// rule); a load naming no block at all, a query and a write: every group.
template <typename Block>
std::vector<bool> StorageExecutor::Impl::taking_part(TaskKind kind, std::uint32_t n, Block& block) const {
  const auto num_groups = static_cast<std::uint32_t>(t.groups.size());
  std::vector<bool> part(num_groups, true);
  if (kind != TaskKind::kStorageRead && kind != TaskKind::kPrefetch) return part;
  bool any = false;
  for (std::uint32_t g = 0; g < num_groups; ++g) {
    bool named = false;
    for (std::uint32_t i = 0; i < n && !named; ++i) named = block(g, i) >= 0;
    part[g] = named;
    any = any || named;
  }
  if (!any) part.assign(num_groups, true);
  return part;
}

// This rank's answer: for a write, the leading keys whose every named block is stored; else the
// loadable prefix by the groups' rules.
template <typename Present, typename Block>
std::uint32_t StorageExecutor::Impl::local_answer(TaskKind kind, std::uint32_t n, Present& present, Block& block,
                                                  const std::vector<std::vector<bool>>& here) const {
  if (kind != TaskKind::kStorageWrite) return proto::loadable_prefix(t.layout, n, present).pages;
  auto stored = [&](std::uint32_t i) {
    for (std::uint32_t g = 0; g < t.groups.size(); ++g)
      if (block(g, i) >= 0 && !here[g][i]) return false;
    return true;
  };
  std::uint32_t local = 0;
  while (local < n && stored(local)) ++local;
  return local;
}

bool StorageExecutor::Impl::group_presence(const Prepared& p, const std::string& key_prefix,
                                           std::vector<std::vector<std::string>>& group_names,
                                           std::vector<std::vector<bool>>& here) {
  const auto& w = p.work;
  const bool query = static_cast<TaskKind>(w.header.kind) == TaskKind::kStorageQuery;
  for (std::uint32_t g = 0; g < t.groups.size(); ++g) {
    std::vector<std::string> asked;
    std::vector<std::size_t> at;
    for (std::size_t i = 0; i < p.which.size(); ++i) {
      group_names[g].push_back(names.of_group(w.section.keys[p.which[i]], key_prefix, w.section.args.weight_version,
                                              t.groups[g].replicated));
      if (!query && group_block(t, w, g, p.which[i]) < 0) continue;  // nothing to load into or write from
      asked.push_back(group_names[g].back());
      at.push_back(i);
    }
    here[g].assign(p.which.size(), false);
    if (asked.empty()) continue;
    auto found = storage::presence(*t.groups[g].store, asked);
    if (!found.ok()) {
      fail_before_agreement(w, status_of(found.error().code, StoreCall::kLookup), p.start,
                            unavailable(fmt::format("cache group {}: {}", g, found.error().message)));
      return false;
    }
    for (std::size_t j = 0; j < at.size(); ++j) here[g][at[j]] = (*found)[j];
  }
  return true;
}

bool StorageExecutor::Impl::agree_groups(Prepared& p, std::vector<std::size_t> which, const std::string& key_prefix) {
  const auto& w = p.work;
  const auto kind = static_cast<TaskKind>(w.header.kind);
  const auto num_groups = static_cast<std::uint32_t>(t.groups.size());
  p.which = std::move(which);  // what the lambdas below index: the keys taking part
  const auto n = static_cast<std::uint32_t>(p.which.size());
  // here[g][i]: group g's object of key which[i] is stored on this rank.
  std::vector<std::vector<std::string>> group_names(num_groups);
  std::vector<std::vector<bool>> here(num_groups);
  if (!group_presence(p, key_prefix, group_names, here)) return false;
  auto block = [&](std::uint32_t g, std::uint32_t i) { return group_block(t, w, g, p.which[i]); };
  const std::vector<bool> part = taking_part(kind, n, block);
  // A load's page counts only where the task gives it a block: group_presence asked no other. A
  // group that takes no part in a load holds its rule everywhere.
  auto present = [&](std::uint32_t g, std::uint32_t i) { return !part[g] || here[g][i]; };
  auto agreed = agree_on(w, local_answer(kind, n, present, block, here), p.start);
  if (!agreed) return false;
  p.agreed = *agreed;
  if (kind != TaskKind::kStorageWrite && t.metrics != nullptr) t.metrics->storage_lookup(kind, p.agreed, n - p.agreed);
  auto add = [&](std::uint32_t g, std::uint32_t i) {
    p.units.push_back(Prepared::Unit{i, g, block(g, i)});
    p.stored.push_back(group_names[g][i]);
  };
  switch (kind) {
    case TaskKind::kStorageQuery:
      finish(w, proto::Outcome::ok(p.agreed), p.start);
      return false;
    case TaskKind::kStorageWrite:
      for (std::uint32_t g = 0; g < num_groups; ++g)  // group-major: phase 2 moves a group's run at once
        for (std::uint32_t i = p.agreed; i < n; ++i)
          if (block(g, i) >= 0) add(g, i);
      if (p.units.empty()) {
        finish(w, proto::Outcome::written(0, w.section.keys.size()), p.start);
        return false;
      }
      return true;
    case TaskKind::kPrefetch:
    case TaskKind::kStorageRead:
      break;
    default:
      finish(w, proto::Outcome::failed(TaskStatus::kInternal, "not a storage task"), p.start);
      return false;
  }
  if (p.agreed == 0 || (kind == TaskKind::kPrefetch && p.agreed < w.section.args.min_hits)) {
    finish(w, proto::Outcome::ok(), p.start);  // nothing to load (a prefetch below min_hits keeps nothing)
    return false;
  }
  if (proto::loadable_prefix(t.layout, p.agreed, present).pages != p.agreed) {
    KVTD_INFO("task {}: the ranks agreed on {} pages, but a window or state page at that point is not stored on this "
              "rank; nothing loaded (the merged answer is 0 blocks)",
              w.header.task_id, p.agreed);
    finish(w, proto::Outcome::ok(), p.start);
    return false;
  }
  for (std::uint32_t g = 0; g < num_groups; ++g) {
    if (!part[g]) continue;
    const std::uint32_t need = t.groups[g].trailing;
    for (std::uint32_t i = need == 0 ? 0 : p.agreed - std::min(need, p.agreed); i < p.agreed; ++i) add(g, i);
  }
  return true;
}

}  // namespace kvtd::daemon
