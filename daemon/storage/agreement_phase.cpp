// Phase 1 of a storage task, on the agreement thread: checked, selected, asked of the store and
// agreed across ranks (MIN); a task that fails here aborts its agreement so the peers stop waiting.
#include <fmt/format.h>
#include <numeric>

#include "executor_impl.h"
#include "kvtd/daemon/status_of.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::daemon {

void StorageExecutor::Impl::abort_agreement(const StorageWork& w, TaskStatus why) {
  ep.abort_agreement(w.header.seq, why);
  if (t.metrics != nullptr) t.metrics->agreement_failed(why, /*this_rank=*/true);
}

void StorageExecutor::Impl::fail_before_agreement(const StorageWork& w, TaskStatus s, std::int64_t start, const std::string& msg) {
  abort_agreement(w, s);
  ep.leave_agreements(w.header.seq + 1);  // the agreement thread runs tasks in ring order
  finish(w, proto::Outcome::failed(s, msg), start);
}

bool StorageExecutor::Impl::may_agree(const StorageWork& w, std::int64_t start) {
  if (w.answered) {  // the engine has its completion; the peers are told
    abort_agreement(w, *w.answered);
    ep.leave_agreements(w.header.seq + 1);
    return false;
  }
  {
    MutexLock g(stats_mu);
    ++tasks;
  }
  if (revoked(w)) return false;
  if (w.header.deadline_ns != 0 && start > w.header.deadline_ns) {
    fail_before_agreement(w, TaskStatus::kDeadlineExceeded, start,
                          fmt::format("deadline passed {} us before execution", (start - w.header.deadline_ns) / 1000));
    return false;
  }
  if (queues.is_cancelled(w.header.task_id)) {
    fail_before_agreement(w, TaskStatus::kCancelled, start, "cancelled before it started");
    return false;
  }
  if (t.store != nullptr) return true;
  if ((w.header.flags & (proto::kTaskFlagPolicyBackup | proto::kTaskFlagEvictBackup)) != 0) {
    // No storage tier here: nothing to back up to, not an error on this rank. The peers are told
    // (they do have a store, or they would not wait): a mismatch is their failure.
    abort_agreement(w, TaskStatus::kStorageUnavailable);
    ep.leave_agreements(w.header.seq + 1);
    finish(w, proto::Outcome::written(0, w.section.keys.size()), start);
    return false;
  }
  fail_before_agreement(w, TaskStatus::kStorageUnavailable, start, t.no_store_reason);
  return false;
}

bool StorageExecutor::Impl::agree_phase(Prepared& p) {
  const auto& w = p.work;
  p.start = ipc::monotonic_now_ns();
  const auto kind = static_cast<TaskKind>(w.header.kind);
  if (!may_agree(w, p.start)) return false;
  std::vector<std::size_t> which;
  if (kind == TaskKind::kStorageWrite) {
    which = policy.selected(w);
  } else {
    policy.count_uses(w.section.keys);
    which.resize(w.section.keys.size());
    std::iota(which.begin(), which.end(), std::size_t{0});
  }
  auto key_prefix = names.key_prefix_for(w.section.args.weight_version);
  if (!key_prefix.ok()) {
    fail_before_agreement(w, TaskStatus::kStorageUnavailable, p.start, "storage key prefix: " + key_prefix.error().message);
    return false;
  }
  if (!t.groups.empty()) return agree_groups(p, std::move(which), *key_prefix);
  p.parts = t.slicing.parts;
  p.stored.reserve(which.size() * p.parts);
  for (auto i : which) {
    for (std::uint32_t part = 0; part < p.parts; ++part)
      p.stored.push_back(names.of(w.section.keys[i], *key_prefix, w.section.args.weight_version, part));
    if (!w.blocks.empty()) p.ids.push_back(w.blocks[i]);
  }
  p.which = std::move(which);
  auto agreed = local_then_agree(w, p.stored, p.parts, p.start);
  if (!agreed) return false;
  p.agreed = *agreed;
  if (kind != TaskKind::kStorageWrite && t.metrics != nullptr)
    t.metrics->storage_lookup(kind, p.agreed, p.keys() - p.agreed);
  return needs_objects_moved(p, kind);
}

std::optional<std::uint32_t> StorageExecutor::Impl::local_then_agree(const StorageWork& w,
                                                                    const std::vector<std::string>& objects,
                                                                    std::uint32_t parts, std::int64_t start) {
  auto local = t.store->exists(objects);
  if (!local.ok()) {
    fail_before_agreement(w, status_of(local.error().code, StoreCall::kLookup), start,
                          unavailable(local.error().message));
    return std::nullopt;
  }
  // A key is here when every part of it is: the leading objects present, in whole keys.
  return agree_on(w, static_cast<std::uint32_t>(*local / parts), start);
}

std::optional<std::uint32_t> StorageExecutor::Impl::agree_on(const StorageWork& w, std::uint32_t local,
                                                            std::int64_t start) {
  auto agreed = ep.agree(w.header.seq, local, w.header.deadline_ns);
  if (!agreed.ok()) {
    if (revoked(w)) return std::nullopt;  // the engine failed it already
    if (t.metrics != nullptr) t.metrics->agreement_failed(agreed.error().code, /*this_rank=*/false);
    finish(w, proto::Outcome::failed(agreed.error().code, agreed.error().message), start);
    return std::nullopt;
  }
  return *agreed;
}

bool StorageExecutor::Impl::needs_objects_moved(const Prepared& p, TaskKind kind) {
  const auto& w = p.work;
  switch (kind) {
    case TaskKind::kStorageQuery:
      finish(w, proto::Outcome::ok(p.agreed), p.start);
      return false;
    case TaskKind::kPrefetch:
      if (p.agreed < w.section.args.min_hits) {
        finish(w, proto::Outcome::ok(), p.start);  // revoked: fewer hits than asked for, nothing kept
        return false;
      }
      [[fallthrough]];
    case TaskKind::kStorageRead:
      if (p.agreed == 0) {
        finish(w, proto::Outcome::ok(), p.start);
        return false;
      }
      return true;
    case TaskKind::kStorageWrite:
      if (p.agreed == p.keys()) {
        finish(w, proto::Outcome::written(0, w.section.keys.size()), p.start);
        return false;
      }
      return true;
    default:
      finish(w, proto::Outcome::failed(TaskStatus::kInternal, "not a storage task"), p.start);
      return false;
  }
}

}  // namespace kvtd::daemon
