#include "task_decoder.h"

#include <array>
#include <cstring>
#include <fmt/format.h>
#include <vector>

#include "kvtd/ipc/task_codec.h"

namespace kvtd::daemon {
namespace {

using proto::TaskKind;
using proto::TaskStatus;
using Action = DecodedRecord::Action;

TaskStatus status_of(kernels::PlanErrc e) {
  switch (e) {
    case kernels::PlanErrc::kLengthMismatch: return TaskStatus::kLengthMismatch;
    case kernels::PlanErrc::kSourceOutOfRange:
    case kernels::PlanErrc::kDestinationOutOfRange: return TaskStatus::kIdOutOfRange;
    case kernels::PlanErrc::kDuplicateDestination: return TaskStatus::kDuplicateDestination;
    case kernels::PlanErrc::kSizeOverflow: return TaskStatus::kMalformed;
  }
  return TaskStatus::kInternal;
}

DecodedRecord& fail(DecodedRecord& d, TaskStatus s, std::string message) {
  d.action = Action::kFail;
  d.status = s;
  d.message = std::move(message);
  return d;
}

std::string late(const proto::TaskRecordHeader& h, std::int64_t now) {
  return fmt::format("deadline passed {} us before dispatch", (now - h.deadline_ns) / 1000);
}

// A storage task's block ids (one per key, or a group session's per key and group): each in range
// (a group's in its own group's ids; -1 allowed there: no block), none loaded twice. False (d
// failed) naming the first bad one.
bool storage_ids_valid(std::span<const std::int32_t> ids, std::size_t keys, bool host, TaskKind kind,
                       const CacheShape& shape, DecodedRecord& d) {
  const std::int64_t limit = host ? shape.host_blocks : shape.device_blocks;
  const bool loads = kind == TaskKind::kStorageRead || kind == TaskKind::kPrefetch;
  std::vector<std::uint8_t> seen(loads ? static_cast<std::size_t>(limit) : 0);
  const char* side = host ? "host" : "device";
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::int64_t lo = 0, hi = limit;
    std::string group;
    if (shape.group_session) {
      const std::size_t g = i / keys;
      if (ids[i] == -1) continue;
      const GroupShape& x = shape.groups[g];
      lo = host ? x.host_base : x.device_base;
      hi = lo + (host ? x.host_blocks : x.device_blocks);
      group = fmt::format(" (cache group {}, key {})", g, i % keys);
    }
    if (ids[i] < lo || ids[i] >= hi) {
      fail(d, TaskStatus::kIdOutOfRange,
           fmt::format("{} block id {} at position {}{} is outside [{}, {})", side, ids[i], i, group, lo, hi));
      return false;
    }
    if (loads && seen[static_cast<std::size_t>(ids[i])]++) {
      fail(d, TaskStatus::kDuplicateDestination, fmt::format("block id {} is loaded twice", ids[i]));
      return false;
    }
  }
  return true;
}

// A storage record: its section decoded, its blocks checked; CANCEL answered by the caller.
DecodedRecord& decode_storage(DecodedRecord& d, std::span<const std::int32_t> section,
                              std::span<const std::int32_t> ids, const CacheShape& shape, std::int64_t now) {
  const auto& h = d.work.header;
  const auto kind = static_cast<TaskKind>(h.kind);
  d.abort_agreement = kind != TaskKind::kCancel;  // every failure below: the peers stop waiting
  auto sec = ipc::decode_storage_section(section, h.num_keys);
  if (!sec.ok()) return fail(d, sec.error().code, sec.error().message);
  if (kind == TaskKind::kCancel) {
    if (!ids.empty() || !sec->keys.empty()) return fail(d, TaskStatus::kMalformed, "CANCEL carries no keys or blocks");
    d.action = Action::kCancel;
    d.cancel_task_id = sec->args.cancel_task_id;
    return d;
  }
  // A group session's record names a block per key and group, group-major (-1: none).
  const std::size_t per_key = shape.group_session ? shape.groups.size() : 1;
  if (kind == TaskKind::kStorageQuery) {
    if (!ids.empty()) return fail(d, TaskStatus::kMalformed, "STORAGE_QUERY carries keys only");
  } else if (ids.size() != sec->keys.size() * per_key) {
    return fail(d, TaskStatus::kLengthMismatch,
                fmt::format("{} keys for {} blocks{}", sec->keys.size(), ids.size(),
                            per_key == 1 ? std::string()
                                         : fmt::format(" (a session of {} cache groups names a block per key and "
                                                       "group, group-major)", per_key)));
  }
  const bool host = (h.flags & proto::kTaskFlagHostBlocks) != 0;
  if (kind == TaskKind::kPrefetch && !host) return fail(d, TaskStatus::kMalformed, "PREFETCH loads into host blocks only");
  if (!storage_ids_valid(ids, sec->keys.size(), host, kind, shape, d)) return d;
  if (h.deadline_ns != 0 && now > h.deadline_ns) return fail(d, TaskStatus::kDeadlineExceeded, late(h, now));
  d.action = Action::kRun;
  d.abort_agreement = false;
  d.work.storage = true;
  d.work.storage_work.header = h;
  if ((h.flags & proto::kTaskFlagBackupPair) != 0) d.work.backup_of_swap = h.after_task_id;
  d.work.storage_work.section = std::move(sec).value();
  d.work.storage_work.blocks.assign(ids.begin(), ids.end());
  (host ? d.work.host_ids : d.work.device_ids) = d.work.storage_work.named_blocks();
  return d;
}

// Group `g`'s index in `shape` whose ids on one side hold `id`; -1 when none does.
int group_of(const CacheShape& shape, std::int64_t id, bool device) {
  for (std::size_t g = 0; g < shape.groups.size(); ++g) {
    const GroupShape& x = shape.groups[g];
    const std::int64_t base = device ? x.device_base : x.host_base, n = device ? x.device_blocks : x.host_blocks;
    if (id >= base && id < base + n) return static_cast<int>(g);
  }
  return -1;
}

// A swap's pairs cut by cache group, each group's planned in its own ids: false (d failed) when a
// pair leaves its group or a group's plan is refused.
bool plan_parts(std::span<const std::int32_t> src, std::span<const std::int32_t> dst, bool to_host,
                const CacheShape& shape, DecodedRecord& d) {
  const char* side_note = to_host ? " (source: device blocks, destination: host blocks)"
                                  : " (source: host blocks, destination: device blocks)";
  const std::size_t n = shape.groups.size();
  if (n == 1) {  // one group, ids as given: no cutting (the common case, kept as lean as before groups)
    const GroupShape& x = shape.groups[0];
    auto plan = kernels::plan_copy(src, dst, to_host ? x.device_blocks : x.host_blocks,
                                   to_host ? x.host_blocks : x.device_blocks, x.block_bytes);
    if (!plan.ok()) {
      fail(d, status_of(plan.error().code), plan.error().message + side_note);
      return false;
    }
    SwapPart& part = d.work.parts.emplace_back();
    part.plan = std::move(plan).value();
    part.device_ids.assign(to_host ? src.begin() : dst.begin(), to_host ? src.end() : dst.end());
    part.host_ids.assign(to_host ? dst.begin() : src.begin(), to_host ? dst.end() : src.end());
    return true;
  }
  std::vector<std::vector<std::int32_t>> from(n), to(n);
  {
    if (src.size() != dst.size()) {
      fail(d, TaskStatus::kLengthMismatch,
           fmt::format("{} source and {} destination blocks{}", src.size(), dst.size(), side_note));
      return false;
    }
    for (std::size_t i = 0; i < src.size(); ++i) {
      const int g = group_of(shape, src[i], to_host);
      const int h = group_of(shape, dst[i], !to_host);
      if (g < 0 || g != h) {
        auto where = [](int x) {
          return x < 0 ? std::string("outside every cache group") : fmt::format("in cache group {}", x);
        };
        fail(d, TaskStatus::kIdOutOfRange,
             fmt::format("pair {}: source block {} is {} and destination block {} is {}; "
                         "a pair stays inside one group{}",
                         i, src[i], where(g), dst[i], where(h), side_note));
        return false;
      }
      const GroupShape& x = shape.groups[static_cast<std::size_t>(g)];
      from[g].push_back(static_cast<std::int32_t>(src[i] - (to_host ? x.device_base : x.host_base)));
      to[g].push_back(static_cast<std::int32_t>(dst[i] - (to_host ? x.host_base : x.device_base)));
    }
  }
  for (std::size_t g = 0; g < n; ++g) {
    if (from[g].empty()) continue;
    const GroupShape& x = shape.groups[g];
    auto plan = kernels::plan_copy(from[g], to[g], to_host ? x.device_blocks : x.host_blocks,
                                   to_host ? x.host_blocks : x.device_blocks, x.block_bytes);
    if (!plan.ok()) {
      fail(d, status_of(plan.error().code),
           fmt::format("cache group {} (its own block ids): {}{}", g, plan.error().message, side_note));
      return false;
    }
    SwapPart part;
    part.group = static_cast<std::uint32_t>(g);
    part.plan = std::move(plan).value();
    part.device_ids = to_host ? std::move(from[g]) : std::move(to[g]);
    part.host_ids = to_host ? std::move(to[g]) : std::move(from[g]);
    d.work.parts.push_back(std::move(part));
  }
  return true;
}

}  // namespace

DecodedRecord decode_record(std::span<const std::byte> record, const CacheShape& shape, std::int64_t now) {
  DecodedRecord d;
  auto decoded = ipc::decode_task_record(record, &d.work.header);
  if (!decoded.ok()) return fail(d, decoded.error().code, decoded.error().message);
  const auto& h = d.work.header;
  const auto kind = static_cast<TaskKind>(h.kind);
  const auto src = decoded->src, dst = decoded->dst;
  if (kind == TaskKind::kClearCache) {
    d.action = Action::kClear;
    return d;
  }
  if (kind == TaskKind::kRestoreCache) {
    d.action = Action::kRestore;
    return d;
  }
  if (proto::is_storage_kind(kind)) return decode_storage(d, src, dst, shape, now);
  const bool to_host = kind == TaskKind::kSwapToHost;
  if (!plan_parts(src, dst, to_host, shape, d)) return d;
  if (h.deadline_ns != 0 && now > h.deadline_ns) return fail(d, TaskStatus::kDeadlineExceeded, late(h, now));
  if (!decoded->events.empty()) {
    const std::size_t n = decoded->events.size() / proto::kEngineEventBytes;
    if (n != shape.num_ranks)
      return fail(d, TaskStatus::kMalformed,
                  fmt::format("{} engine events for {} ranks", n, shape.num_ranks));
    std::array<std::uint8_t, proto::kEngineEventBytes> ev{};  // private copy: never re-read the ring
    std::memcpy(ev.data(), decoded->events.data() + std::size_t{shape.rank} * proto::kEngineEventBytes, ev.size());
    d.work.engine_event = ev;
  }
  d.action = Action::kRun;
  d.work.device_ids.assign(to_host ? src.begin() : dst.begin(), to_host ? src.end() : dst.end());
  d.work.host_ids.assign(to_host ? dst.begin() : src.begin(), to_host ? dst.end() : src.end());
  return d;
}

}  // namespace kvtd::daemon
