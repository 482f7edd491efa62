#include "kvtd/ipc/task_codec.h"

#include "kvtd/proto/names.h"

#include "kvtd/proto/geometry.h"

#include <cstring>
#include <string>
#include <string_view>

namespace kvtd::ipc {

void write_task_record(std::byte* at, const proto::TaskRecordHeader& hdr_in, std::span<const std::int32_t> src,
                       std::span<const std::int32_t> dst, std::span<const std::byte> events) {
  proto::TaskRecordHeader hdr = hdr_in;
  hdr.num_src = static_cast<std::uint32_t>(src.size());
  hdr.num_dst = static_cast<std::uint32_t>(dst.size());
  const auto num_events = static_cast<std::uint32_t>(events.size() / proto::kEngineEventBytes);
  hdr.flags = static_cast<std::uint16_t>(num_events != 0 ? hdr.flags | proto::kTaskFlagEngineEvent
                                                         : hdr.flags & ~proto::kTaskFlagEngineEvent);
  hdr.record_bytes = static_cast<std::uint32_t>(proto::task_record_bytes(hdr.num_src, hdr.num_dst, num_events));
  std::memcpy(at, &hdr, sizeof hdr);
  if (!src.empty()) std::memcpy(at + sizeof hdr, src.data(), 4 * src.size());
  if (!dst.empty()) std::memcpy(at + sizeof hdr + 4 * src.size(), dst.data(), 4 * dst.size());
  if (num_events != 0)
    std::memcpy(at + proto::task_record_bytes(hdr.num_src, hdr.num_dst), events.data(),
                std::size_t{num_events} * proto::kEngineEventBytes);
}

std::vector<std::byte> encode_task_record(const proto::TaskRecordHeader& hdr, std::span<const std::int32_t> src,
                                          std::span<const std::int32_t> dst, std::span<const std::byte> events) {
  std::vector<std::byte> out(proto::task_record_bytes(static_cast<std::uint32_t>(src.size()),
                                                      static_cast<std::uint32_t>(dst.size()),
                                                      static_cast<std::uint32_t>(events.size() / proto::kEngineEventBytes)));
  write_task_record(out.data(), hdr, src, dst, events);
  return out;
}

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
  if (h.kind == 0 || h.kind > proto::kMaxTaskKind)
    return make_error(TaskStatus::kUnknownKind, "unknown task kind " + std::to_string(h.kind));
  if ((h.flags & ~proto::kTaskFlagsKnown) != 0)
    return make_error(TaskStatus::kMalformed, "unknown task flags " + std::to_string(h.flags));
  if ((h.flags & proto::kTaskFlagLayerwise) && kind != TaskKind::kSwapToDevice)
    return make_error(TaskStatus::kMalformed, "the layer-by-layer flag is only valid on SWAP_TO_DEVICE");
  if ((h.flags & proto::kTaskFlagHostBlocks) && !proto::is_storage_kind(kind))
    return make_error(TaskStatus::kMalformed, "the host-blocks flag is only valid on storage tasks");
  if ((h.flags & (proto::kTaskFlagPolicyBackup | proto::kTaskFlagEvictBackup)) &&
      (kind != TaskKind::kStorageWrite || !(h.flags & proto::kTaskFlagHostBlocks)))
    return make_error(TaskStatus::kMalformed, "the backup flags are only valid on STORAGE_WRITE of host blocks");
  if ((h.flags & proto::kTaskFlagBackupPair) && kind != TaskKind::kSwapToHost &&
      (kind != TaskKind::kStorageWrite || !(h.flags & proto::kTaskFlagPolicyBackup) || h.after_task_id == 0))
    return make_error(TaskStatus::kMalformed, "the backup-pair flag is only valid on SWAP_TO_HOST and on its "
                                              "policy backup naming it as after-task");
  if ((h.flags & proto::kTaskFlagDropHostTier) && kind != TaskKind::kClearCache)
    return make_error(TaskStatus::kMalformed, "the drop-host-tier flag is only valid on CLEAR_CACHE");
  if (proto::is_cache_control_kind(kind) && (h.num_src != 0 || h.num_dst != 0 || h.num_keys != 0))
    return make_error(TaskStatus::kMalformed, std::string(proto::task_kind_name(kind)) + " carries no ids or keys");
  if (!proto::is_storage_kind(kind) && h.num_keys != 0)
    return make_error(TaskStatus::kMalformed, "a swap task carries no keys (num_keys " + std::to_string(h.num_keys) + ")");
  const bool with_events = (h.flags & proto::kTaskFlagEngineEvent) != 0;
  if (with_events && kind != TaskKind::kSwapToHost && kind != TaskKind::kSwapToDevice)
    return make_error(TaskStatus::kMalformed, "the engine-event flag is only valid on swap tasks");
  // 64-bit: counts near 2^29 each must not wrap into a size that matches a short record.
  const std::uint64_t ids_bytes = proto::task_record_bytes(h.num_src, h.num_dst);
  const std::uint64_t event_bytes = std::uint64_t{h.record_bytes} - ids_bytes;  // checked below before use
  const bool sized = with_events ? ids_bytes < h.record_bytes && event_bytes % proto::kEngineEventBytes == 0 &&
                                       event_bytes / proto::kEngineEventBytes <= proto::kMaxRanks
                                 : ids_bytes == h.record_bytes;
  if (!sized || h.record_bytes != rec.size())
    return make_error(TaskStatus::kMalformed, "record of " + std::to_string(rec.size()) + " bytes does not hold " +
                                                  std::to_string(h.num_src) + " source and " + std::to_string(h.num_dst) +
                                                  " destination ids" + (with_events ? " and whole engine events" : ""));
  const auto* ids = reinterpret_cast<const std::int32_t*>(rec.data() + sizeof(proto::TaskRecordHeader));
  t.src = {ids, h.num_src};
  t.dst = {ids + h.num_src, h.num_dst};
  if (with_events) t.events = rec.subspan(ids_bytes, event_bytes);
  return t;
}

// The storage keys' character rule (proto/names.h), at the engine's shorter bound: the stored
// name adds the key prefix, the weight versions and the rank (kvtd/storage/object_name.h).
bool valid_engine_key(std::string_view key) { return proto::valid_name(key, proto::kMaxKeyBytes, /*allow_colon=*/true); }

std::vector<std::int32_t> encode_storage_section(const proto::StorageTaskArgs& args_in,
                                                 std::span<const std::string> keys) {
  proto::StorageTaskArgs args = args_in;
  std::uint64_t chars = 0;
  for (const auto& k : keys) chars += k.size();
  args.key_bytes = static_cast<std::uint32_t>(chars);
  std::vector<std::int32_t> words(proto::storage_section_words(keys.size(), chars), 0);
  auto* out = reinterpret_cast<std::byte*>(words.data());
  std::memcpy(out, &args, sizeof args);
  std::size_t pos = sizeof args;
  for (const auto& k : keys) {
    const auto len = static_cast<std::uint16_t>(k.size());
    std::memcpy(out + pos, &len, sizeof len);
    pos += sizeof len;
  }
  pos = sizeof args + (2 * keys.size() + 3) / 4 * 4;
  for (const auto& k : keys) {
    std::memcpy(out + pos, k.data(), k.size());
    pos += k.size();
  }
  return words;
}

Result<StorageSection, proto::TaskStatus> decode_storage_section(std::span<const std::int32_t> words,
                                                                 std::uint32_t num_keys) {
  using proto::TaskStatus;
  StorageSection s;
  const std::uint64_t have = std::uint64_t{words.size()} * 4;
  if (have < sizeof s.args)
    return make_error(TaskStatus::kMalformed, "storage section of " + std::to_string(have) + " bytes has no arguments");
  const auto* in = reinterpret_cast<const std::byte*>(words.data());
  std::memcpy(&s.args, in, sizeof s.args);
  if (num_keys > proto::kMaxKeysPerTask)
    return make_error(TaskStatus::kMalformed, std::to_string(num_keys) + " keys exceed the limit of " +
                                                  std::to_string(proto::kMaxKeysPerTask) + " per task");
  // 64-bit: both counts come from shared memory.
  if (proto::storage_section_words(num_keys, s.args.key_bytes) != words.size())
    return make_error(TaskStatus::kMalformed, "storage section of " + std::to_string(words.size()) +
                                                  " words does not hold " + std::to_string(num_keys) + " keys of " +
                                                  std::to_string(s.args.key_bytes) + " characters");
  std::vector<std::uint16_t> lens(num_keys);
  if (num_keys != 0) std::memcpy(lens.data(), in + sizeof s.args, 2ull * num_keys);  // (no null memcpy: UB)
  std::uint64_t sum = 0;
  for (auto l : lens) sum += l;
  if (sum != s.args.key_bytes)
    return make_error(TaskStatus::kMalformed, "key lengths add up to " + std::to_string(sum) + ", the section says " +
                                                  std::to_string(s.args.key_bytes));
  const auto* chars = reinterpret_cast<const char*>(in + sizeof s.args + (2ull * num_keys + 3) / 4 * 4);
  s.keys.reserve(num_keys);
  std::uint64_t pos = 0;
  for (std::uint32_t i = 0; i < num_keys; ++i) {
    std::string_view k(chars + pos, lens[i]);
    pos += lens[i];
    if (!valid_engine_key(k))
      return make_error(TaskStatus::kMalformed,
                        "key " + std::to_string(i) + " is not 1-" + std::to_string(proto::kMaxKeyBytes) +
                            " characters of [A-Za-z0-9_.:-] (length " + std::to_string(k.size()) + ")");
    s.keys.emplace_back(k);
  }
  return s;
}

}  // namespace kvtd::ipc
