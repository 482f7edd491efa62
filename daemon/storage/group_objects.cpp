// Phase 2 of a group session's storage task, on an I/O worker: each unit's object between its
// group's block and its group's store, a run of one group at a time through the worker's slice,
// with the cancel, revocation and deadline checks between runs.
//
// A load is whole or nothing on a rank: the pages a window or state group needs at the agreed
// point are not a prefix of anything smaller, so a load that misses or fails one object reports
// 0 blocks (the engine's merge is then 0), never a shorter prefix whose trailing pages were not
// loaded.
#include <algorithm>
#include <fmt/format.h>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/status_of.h"
#include "kvtd/events/kv_events.h"
#include "kvtd/metrics/registry.h"
#include "kvtd/ipc/clock.h"
#include "object_mover.h"

namespace kvtd::daemon {

using proto::Outcome;
using proto::TaskStatus;

std::vector<GroupRun> ObjectMover::group_runs(const Prepared& p) const {
  constexpr std::uint64_t kStepBytes = 4ull << 20;
  const std::uint64_t slice_bytes = chunk_objects_ * t_.object_bytes;
  std::vector<GroupRun> runs;
  std::size_t at = 0;
  while (at < p.units.size()) {
    const std::uint32_t g = p.units[at].group;
    const std::uint64_t bytes = t_.groups[g].object_bytes;
    const std::uint64_t by_step = std::max<std::uint64_t>(kStepBytes / bytes, t_.config.io_threads);
    const auto most = static_cast<std::size_t>(std::max<std::uint64_t>(1, std::min(by_step, slice_bytes / bytes)));
    std::size_t end = at;
    while (end < p.units.size() && end - at < most && p.units[end].group == g) ++end;
    runs.push_back(GroupRun{g, at, end});
    at = end;
  }
  return runs;
}

namespace {

std::vector<std::int32_t> run_ids(const Prepared& p, const GroupRun& run) {
  std::vector<std::int32_t> ids;
  ids.reserve(run.to - run.from);
  for (std::size_t u = run.from; u < run.to; ++u) ids.push_back(p.units[u].id);
  return ids;
}

}  // namespace

std::optional<Outcome> ObjectMover::load_groups(const Prepared& p, std::byte* slice) {
  const auto& w = p.work;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  const auto runs = group_runs(p);
  const std::size_t total = p.units.size();
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const GroupRun& run = runs[r];
    if (auto late = past_deadline(w, run.from, total)) return late;
    if (!queues_.may_continue(w.header.task_id, r + 1 == runs.size()))
      return Outcome::stopped(TaskStatus::kCancelled, 0,
                              fmt::format("cancelled after {} of {} objects; nothing is reported loaded",
                                          run.from, total));
    const auto ids = run_ids(p, run);
    if (revoked(w)) return std::nullopt;  // checked right before writing engine memory
    HostPool* const pool = t_.groups[run.group].pool;
    if (host && pool != nullptr) pool->mark_invalid(ids);
    auto got = load_chunk(group_target(run.group, host), host, ids,
                          std::span(p.stored).subspan(run.from, run.to - run.from), slice);
    if (got.ended) return got.ended;  // failed: no block counts as loaded
    std::vector<std::int32_t> valid;
    const storage::KeyResult* first_bad = nullptr;
    std::size_t bad_at = 0;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (got.keys[i].ok()) {
        valid.push_back(ids[i]);
      } else if (first_bad == nullptr) {
        first_bad = &got.keys[i];
        bad_at = run.from + i;
      }
    }
    if (host && pool != nullptr) pool->mark_valid(valid);  // each verified object's block holds it
    const std::uint64_t read_bytes = valid.size() * t_.groups[run.group].object_bytes;
    {
      MutexLock g(mu_);
      moved_.objects_read += valid.size();
      moved_.bytes_read += read_bytes;
    }
    if (t_.metrics != nullptr) t_.metrics->group_storage_bytes(run.group, metrics::Direction::kStorageRead, read_bytes);
    if (first_bad == nullptr) continue;
    const std::string& key = w.section.keys[p.which[p.units[bad_at].key]];
    const std::string what = fmt::format("key {} of cache group {}", key, run.group);
    const auto status = status_of(first_bad->result, StoreCall::kRead);
    if (status != TaskStatus::kOk)  // the store failed: not a miss
      return Outcome::stopped(status, 0, unavailable("the store failed reading " + what + ": " + first_bad->error));
    KVTD_INFO("task {}: {} of {} on this rank; nothing loaded (the agreed {} pages need it)", w.header.task_id,
              storage::object_result_name(first_bad->result), what, p.agreed);
    return Outcome::ok(0);
  }
  return Outcome::ok(p.agreed);
}

std::optional<Outcome> ObjectMover::write_groups(const Prepared& p, std::byte* slice) {
  const auto& w = p.work;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  const std::uint64_t skipped = (w.section.keys.size() - p.which.size()) + p.agreed;
  const std::uint64_t keys = p.which.size() - p.agreed;
  if (auto late = stale_backup(p)) return late;
  const auto runs = group_runs(p);
  std::vector<std::vector<std::int32_t>> ids;  // each run's blocks
  for (const GroupRun& run : runs) {
    ids.push_back(run_ids(p, run));
    if (HostPool* pool = t_.groups[run.group].pool; host && pool != nullptr)
      if (auto bad = pool->first_invalid(ids.back()))
        return Outcome::failed(TaskStatus::kHostTierLost,
                               fmt::format("host block {} of cache group {} holds no data written in this session; "
                                           "nothing stored", *bad, run.group));
  }
  const bool in_place = stores_in_place(host);
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const GroupRun& run = runs[r];
    if (revoked(w)) return std::nullopt;
    if (auto late = past_deadline(w, run.from, p.units.size())) return late;
    if (!queues_.may_continue(w.header.task_id, r + 1 == runs.size()))
      return Outcome::stopped(TaskStatus::kCancelled, 0,
                              fmt::format("cancelled after writing {} of {} objects", run.from, p.units.size()))
          .with_skipped(skipped);
    // One copy of a replicated group is enough: rank 0's, under rank 0's name.
    if (t_.groups[run.group].replicated && ep_.rank() != 0) continue;
    if (auto ended = write_objects(group_target(run.group, host), host, ids[r],
                                   std::span(p.stored).subspan(run.from, run.to - run.from), in_place, slice)) {
      ended->message = fmt::format("cache group {}: {}", run.group, ended->message);
      return ended;
    }
    if (t_.metrics != nullptr)
      t_.metrics->group_storage_bytes(run.group, metrics::Direction::kStorageWrite,
                                      (run.to - run.from) * t_.groups[run.group].object_bytes);
  }
  if (t_.kv_events != nullptr && keys != 0) {  // rank 0 only: one event per key written, whatever its groups
    std::vector<std::string> stored_keys;
    for (std::size_t i = p.agreed; i < p.which.size(); ++i) stored_keys.push_back(w.section.keys[p.which[i]]);
    t_.kv_events->stored(std::move(stored_keys));
  }
  return Outcome::written(keys, skipped);
}

}  // namespace kvtd::daemon
