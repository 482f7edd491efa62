#include "kvtd/ipc/task_codec.h"

#include <cstring>
#include <string>

namespace kvtd::ipc {

Result<DecodedTask, proto::TaskStatus> decode_task_record(std::span<const std::byte> rec,
                                                          proto::TaskRecordHeader* header_out) {
  using proto::TaskKind;
  using proto::TaskStatus;
  DecodedTask t;
  if (rec.size() < sizeof t.header)
    return make_error(TaskStatus::kMalformed, "record of " + std::to_string(rec.size()) + " bytes has no full header");
  std::memcpy(&t.header, rec.data(), sizeof t.header);
  if (header_out) *header_out = t.header;
  const auto& h = t.header;
  if (h.format_version != proto::kTaskFormatVersion)
    return make_error(TaskStatus::kBadVersion, "task format version " + std::to_string(h.format_version) +
                                                   " is not supported (daemon speaks " +
                                                   std::to_string(proto::kTaskFormatVersion) + ")");
  const auto kind = static_cast<TaskKind>(h.kind);
  if (kind != TaskKind::kSwapToHost && kind != TaskKind::kSwapToDevice)
    return make_error(TaskStatus::kUnknownKind, "unknown task kind " + std::to_string(h.kind));
  if ((h.flags & proto::kTaskFlagLayerwise) && kind != TaskKind::kSwapToDevice)
    return make_error(TaskStatus::kMalformed, "the layer-by-layer flag is only valid on SWAP_TO_DEVICE");
  if ((h.flags & ~proto::kTaskFlagLayerwise) != 0)
    return make_error(TaskStatus::kMalformed, "unknown task flags " + std::to_string(h.flags));
  // 64-bit: counts near 2^29 each must not wrap into a size that matches a short record.
  if (proto::task_record_bytes(h.num_src, h.num_dst) != std::uint64_t{h.record_bytes} || h.record_bytes != rec.size())
    return make_error(TaskStatus::kMalformed, "record of " + std::to_string(rec.size()) + " bytes does not hold " +
                                                  std::to_string(h.num_src) + " source and " + std::to_string(h.num_dst) +
                                                  " destination ids");
  const auto* ids = reinterpret_cast<const std::int32_t*>(rec.data() + sizeof(proto::TaskRecordHeader));
  t.src = {ids, h.num_src};
  t.dst = {ids + h.num_src, h.num_dst};
  return t;
}

}  // namespace kvtd::ipc
