// kvtd/ipc/rings.h - the task ring (one producer, broadcast to every rank) and the per-rank
// completion rings, as views over memory laid out by kvtd/proto/session.h.
//
// Task ring: a byte ring of variable-length records (header + block ids). The producer may
// reuse bytes only after every attached rank's `consumed` cursor has passed them; a record
// that does not fit before the end of the buffer is preceded by a padding record (kind 0 with
// format_version kPaddingFormat) and written at offset 0. A full ring is never overwritten:
// TaskRingWriter::try_push reports no room.
//
// Capacities and rank counts are given at construction from the caller's validated private
// copy of the layout; nothing here re-reads sizes or offsets from shared memory.
//
// Thread-safety: TaskRingWriter has one user at a time (the engine serialises submits).
// TaskRingReader is one per rank and used by one thread. CompletionRing has exactly one pushing
// thread and one popping thread. Views do not own memory; copy freely.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvtd/proto/session.h"

namespace kvtd::ipc {

class TaskRingWriter {
 public:
  TaskRingWriter(proto::SessionHeader* header, std::byte* ring, std::uint64_t capacity, std::uint32_t num_ranks)
      : h_(header), ring_(ring), cap_(capacity), num_ranks_(num_ranks) {}

  // Appends a record built from `hdr` (record_bytes, format_version and seq are filled here) and
  // the two id lists. Returns false if there is no room now; `seq_out` gets the record's seq.
  // Precondition: fits(num_src, num_dst).
  // `events`: the engine event handles that follow the ids (task_codec.h), or empty.
  bool try_push(const proto::TaskRecordHeader& hdr, std::span<const std::int32_t> src,
                std::span<const std::int32_t> dst, std::uint64_t* seq_out, std::span<const std::byte> events = {});

  // Whether a record of this size can ever fit (at most half the ring, so a wrap always fits).
  bool fits(std::uint64_t num_src, std::uint64_t num_dst, std::uint64_t event_bytes = 0) const;

  // Bytes that may be written now (0 .. capacity).
  std::uint64_t free_bytes() const;

 private:
  proto::SessionHeader* h_;
  std::byte* ring_;
  std::uint64_t cap_;
  std::uint32_t num_ranks_;
};

class TaskRingReader {
 public:
  enum class Read { kRecord, kEmpty, kCorrupt };

  TaskRingReader(proto::SessionHeader* header, const std::byte* ring, std::uint64_t capacity,
                 std::uint32_t rank)
      : h_(header), ring_(ring), cap_(capacity), rank_(rank) {}

  // Copies the next record (header and payload) into `out` and releases its bytes to the
  // producer. kCorrupt means the record framing is broken: the ring can no longer be trusted.
  Read try_pop(std::vector<std::byte>& out);

 private:
  proto::SessionHeader* h_;
  const std::byte* ring_;
  std::uint64_t cap_;
  std::uint32_t rank_;
};

class CompletionRing {
 public:
  CompletionRing(proto::CompletionRingControl* control, proto::CompletionRecord* records,
                 std::uint32_t capacity)
      : c_(control), r_(records), cap_(capacity) {}

  bool try_push(const proto::CompletionRecord& rec);  // false when full
  bool try_pop(proto::CompletionRecord& rec);         // false when empty

 private:
  proto::CompletionRingControl* c_;
  proto::CompletionRecord* r_;
  std::uint32_t cap_;
};

}  // namespace kvtd::ipc
