// kvtd/ipc/task_codec.h - the task-record wire format, both ways: the engine's end encodes a
// record (and a storage task's section) into the ring, the daemon's end decodes one copied out
// of it. tests/fuzz/fuzz_task_record checks that every record the decoder accepts re-encodes to
// the same header fields and words.
//
// The record is hostile input (rule 9): every count and size is checked in 64-bit arithmetic
// against the record's actual length before any id is looked at. A record that fails gets the
// status and message its error completion carries; the ids themselves are validated later by
// the copy planner against the block counts.
//
// Thread-safety: pure functions. The spans in DecodedTask point into the caller's record.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtd/proto/expected.h"
#include "kvtd/proto/task.h"

namespace kvtd::ipc {

// Writes `hdr` with `src` then `dst` (then `events`: whole kEngineEventBytes handles, one per
// rank, with kTaskFlagEngineEvent) at `at` (task_record_bytes(src, dst, events) bytes, 4-byte
// aligned): record_bytes, num_src and num_dst are set from the spans, the event flag from
// `events`; every other field is the caller's.
void write_task_record(std::byte* at, const proto::TaskRecordHeader& hdr, std::span<const std::int32_t> src,
                       std::span<const std::int32_t> dst, std::span<const std::byte> events = {});

// The same record in a buffer of its own (padding bytes zero).
std::vector<std::byte> encode_task_record(const proto::TaskRecordHeader& hdr, std::span<const std::int32_t> src,
                                          std::span<const std::int32_t> dst, std::span<const std::byte> events = {});

struct DecodedTask {
  proto::TaskRecordHeader header{};
  std::span<const std::int32_t> src;
  std::span<const std::int32_t> dst;
  std::span<const std::byte> events;  // kTaskFlagEngineEvent: one kEngineEventBytes handle per rank
};

// Checks format version, kind, flags and that the record holds exactly its id lists. The header
// is copied out (so a misaligned record is fine); src/dst alias `record`, which must be 4-byte
// aligned. On failure the error's code is the completion status (the header fields the
// completion needs are still returned through `header_out` when the record has a full header).
[[nodiscard]] Result<DecodedTask, proto::TaskStatus> decode_task_record(std::span<const std::byte> record,
                                                                        proto::TaskRecordHeader* header_out);

// A storage task's section (see proto/task.h), decoded into private memory.
struct StorageSection {
  proto::StorageTaskArgs args{};
  std::vector<std::string> keys;
};

// Whether `key` is a valid engine key: 1..kMaxKeyBytes of [A-Za-z0-9_.:-].
bool valid_engine_key(std::string_view key);

// Builds the storage section words for `keys` (the caller checked them with valid_engine_key).
std::vector<std::int32_t> encode_storage_section(const proto::StorageTaskArgs& args, std::span<const std::string> keys);

// Decodes the section of a record whose header says `num_keys`: every length, the total and
// each key's characters are checked (kMalformed naming the first bad key).
[[nodiscard]] Result<StorageSection, proto::TaskStatus> decode_storage_section(std::span<const std::int32_t> words,
                                                                             std::uint32_t num_keys);

}  // namespace kvtd::ipc
