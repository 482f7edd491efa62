#include "task_decoder.h"

#include <array>
#include <cstring>
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
  return "deadline passed " + std::to_string((now - h.deadline_ns) / 1000) + " us before dispatch";
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
  if (kind == TaskKind::kStorageQuery) {
    if (!ids.empty()) return fail(d, TaskStatus::kMalformed, "STORAGE_QUERY carries keys only");
  } else if (ids.size() != sec->keys.size()) {
    return fail(d, TaskStatus::kLengthMismatch,
                std::to_string(sec->keys.size()) + " keys for " + std::to_string(ids.size()) + " blocks");
  }
  const bool host = (h.flags & proto::kTaskFlagHostBlocks) != 0;
  if (kind == TaskKind::kPrefetch && !host) return fail(d, TaskStatus::kMalformed, "PREFETCH loads into host blocks only");
  const std::int64_t limit = host ? shape.host_blocks : shape.device_blocks;
  const bool loads = kind == TaskKind::kStorageRead || kind == TaskKind::kPrefetch;
  std::vector<std::uint8_t> seen(loads ? static_cast<std::size_t>(limit) : 0);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limit)
      return fail(d, TaskStatus::kIdOutOfRange,
                  std::string(host ? "host" : "device") + " block id " + std::to_string(ids[i]) + " at position " +
                      std::to_string(i) + " is outside [0, " + std::to_string(limit) + ")");
    if (loads && seen[static_cast<std::size_t>(ids[i])]++)
      return fail(d, TaskStatus::kDuplicateDestination, "block id " + std::to_string(ids[i]) + " is loaded twice");
  }
  if (h.deadline_ns != 0 && now > h.deadline_ns) return fail(d, TaskStatus::kDeadlineExceeded, late(h, now));
  d.action = Action::kRun;
  d.abort_agreement = false;
  d.work.storage = true;
  d.work.storage_work.header = h;
  if ((h.flags & proto::kTaskFlagBackupPair) != 0) d.work.backup_of_swap = h.after_task_id;
  d.work.storage_work.section = std::move(sec).value();
  d.work.storage_work.blocks.assign(ids.begin(), ids.end());
  (host ? d.work.host_ids : d.work.device_ids).assign(ids.begin(), ids.end());
  return d;
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
  auto plan = kernels::plan_copy(src, dst, to_host ? shape.device_blocks : shape.host_blocks,
                                 to_host ? shape.host_blocks : shape.device_blocks, shape.block_bytes);
  if (!plan.ok()) {
    const char* side_note = to_host ? " (source: device blocks, destination: host blocks)"
                                    : " (source: host blocks, destination: device blocks)";
    return fail(d, status_of(plan.error().code), plan.error().message + side_note);
  }
  if (h.deadline_ns != 0 && now > h.deadline_ns) return fail(d, TaskStatus::kDeadlineExceeded, late(h, now));
  if (!decoded->events.empty()) {
    const std::size_t n = decoded->events.size() / proto::kEngineEventBytes;
    if (n != shape.num_ranks)
      return fail(d, TaskStatus::kMalformed,
                  std::to_string(n) + " engine events for " + std::to_string(shape.num_ranks) + " ranks");
    std::array<std::uint8_t, proto::kEngineEventBytes> ev{};  // private copy: never re-read the ring
    std::memcpy(ev.data(), decoded->events.data() + std::size_t{shape.rank} * proto::kEngineEventBytes, ev.size());
    d.work.engine_event = ev;
  }
  d.action = Action::kRun;
  d.work.plan = std::move(plan).value();
  d.work.device_ids.assign(to_host ? src.begin() : dst.begin(), to_host ? src.end() : dst.end());
  d.work.host_ids.assign(to_host ? dst.begin() : src.begin(), to_host ? dst.end() : src.end());
  return d;
}

}  // namespace kvtd::daemon
