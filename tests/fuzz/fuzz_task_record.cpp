// libFuzzer target: one task record as copied out of the ring, through the daemon's decoder and
// back through the encoder (round trip), then
// the storage-section decoder (storage kinds) or the copy planner and (when planning succeeds)
// the host executor over real buffers. Must never
// crash, read or write out of bounds (ASan), or hit undefined behaviour (UBSan).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvtd/ipc/task_codec.h"
#include "kvtd/kernels/copy_plan.h"
#include "kvtd/kernels/host_copy.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // The ring hands the decoder a 16-byte aligned copy; so do we.
  std::vector<std::int32_t> aligned((size + 3) / 4 + 1);
  std::memcpy(aligned.data(), data, size);
  std::span<const std::byte> rec(reinterpret_cast<const std::byte*>(aligned.data()), size);
  kvtd::proto::TaskRecordHeader h{};
  auto t = kvtd::ipc::decode_task_record(rec, &h);
  if (!t.ok()) return 0;
  // Round trip through the one encoder: an accepted record re-encodes to the same header and
  // words (the decoder took its counts from the bytes it checked, nothing from outside them).
  const auto reencoded = kvtd::ipc::encode_task_record(t->header, t->src, t->dst, t->events);
  if (reencoded.size() != t->header.record_bytes || reencoded.size() > rec.size() ||
      std::memcmp(reencoded.data(), rec.data(), sizeof(kvtd::proto::TaskRecordHeader) + 4 * (t->src.size() + t->dst.size())) != 0 ||
      (!t->events.empty() &&
       std::memcmp(reencoded.data() + (reencoded.size() - t->events.size()), t->events.data(), t->events.size()) != 0))
    __builtin_trap();
  if (kvtd::proto::is_storage_kind(static_cast<kvtd::proto::TaskKind>(h.kind))) {
    auto sec = kvtd::ipc::decode_storage_section(t->src, h.num_keys);
    if (!sec.ok()) return 0;
    // A decoded section re-encodes to a section of the same size with the same arguments (padding
    // bytes may differ): the decoder read nothing from outside the section.
    auto again = kvtd::ipc::encode_storage_section(sec->args, sec->keys);
    if (again.size() != t->src.size() ||
        std::memcmp(again.data(), t->src.data(), sizeof(kvtd::proto::StorageTaskArgs)) != 0)
      __builtin_trap();
    for (const auto& k : sec->keys)
      if (!kvtd::ipc::valid_engine_key(k)) __builtin_trap();
    return 0;
  }
  constexpr std::int64_t kDevice = 64, kHost = 48;
  const std::vector<std::uint64_t> block_bytes{16, 8};
  const bool to_host = h.kind == static_cast<std::uint16_t>(kvtd::proto::TaskKind::kSwapToHost);
  auto plan = kvtd::kernels::plan_copy(t->src, t->dst, to_host ? kDevice : kHost, to_host ? kHost : kDevice, block_bytes);
  if (!plan.ok()) return 0;
  // A valid plan must stay inside both sides: run it over buffers of exactly the right size.
  std::vector<std::vector<std::byte>> bufs;
  std::vector<kvtd::kernels::CopyTarget> targets;
  for (auto bb : block_bytes) {
    bufs.emplace_back(bb * static_cast<std::uint64_t>(to_host ? kDevice : kHost), std::byte{1});
    bufs.emplace_back(bb * static_cast<std::uint64_t>(to_host ? kHost : kDevice), std::byte{2});
    targets.push_back(kvtd::kernels::packed_target(bufs[bufs.size() - 2].data(), bufs.back().data(), bb));
  }
  kvtd::kernels::copy_all_host(*plan, targets);
  return 0;
}
