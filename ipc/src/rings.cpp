#include "kvtd/ipc/rings.h"

#include "kvtd/ipc/task_codec.h"

#include <cstring>

namespace kvtd::ipc {
namespace {

// Bytes the slowest attached rank has not consumed yet; the producer may not write past that
// rank's cursor + capacity. With no attached rank, nothing is left to protect. A cursor is the
// consumer's word: one ahead of head or more than a ring behind (a broken or hostile daemon)
// counts as a full ring, so the producer refuses rather than overwrite unread bytes.
std::uint64_t max_unconsumed(const proto::SessionHeader& h, std::uint32_t num_ranks, std::uint64_t head,
                             std::uint64_t cap) {
  std::uint64_t used = 0;
  for (std::uint32_t r = 0; r < num_ranks && r < proto::kMaxRanks; ++r) {
    if (h.ranks[r].attached.load(std::memory_order_acquire) == 0) continue;
    // Acquire pairs with the reader's release store of `consumed`: the reader copied the record
    // out before publishing the cursor, so bytes below it may be overwritten now.
    const std::uint64_t c = h.ranks[r].consumed.load(std::memory_order_acquire);
    const std::uint64_t u = (c > head || head - c > cap) ? cap : head - c;
    if (u > used) used = u;
  }
  return used;
}

}  // namespace

bool TaskRingWriter::fits(std::uint64_t num_src, std::uint64_t num_dst, std::uint64_t event_bytes) const {
  const std::uint64_t bytes =
      sizeof(proto::TaskRecordHeader) + 4 * (num_src + num_dst) + proto::kRecordAlign + event_bytes;
  return num_src < (1u << 30) && num_dst < (1u << 30) && event_bytes < (1u << 20) && bytes <= cap_ / 2;
}

std::uint64_t TaskRingWriter::free_bytes() const {
  const std::uint64_t head = h_->ring_head.load(std::memory_order_relaxed);
  const std::uint64_t used = max_unconsumed(*h_, num_ranks_, head, cap_);
  return used >= cap_ ? 0 : cap_ - used;
}

bool TaskRingWriter::try_push(const proto::TaskRecordHeader& hdr_in, std::span<const std::int32_t> src,
                              std::span<const std::int32_t> dst, std::uint64_t* seq_out,
                              std::span<const std::byte> events) {
  const auto num_src = static_cast<std::uint32_t>(src.size());
  const auto num_dst = static_cast<std::uint32_t>(dst.size());
  const auto num_events = static_cast<std::uint32_t>(events.size() / proto::kEngineEventBytes);
  const std::uint64_t bytes = proto::task_record_bytes(num_src, num_dst, num_events);  // <= cap/2: fits() held
  const std::uint64_t head = h_->ring_head.load(std::memory_order_relaxed);
  const std::uint64_t pos = head % cap_;
  const std::uint64_t contiguous = cap_ - pos;
  const std::uint64_t pad = bytes > contiguous ? contiguous : 0;
  if (free_bytes() < pad + bytes) return false;

  if (pad != 0) {
    proto::TaskRecordHeader filler{};
    filler.record_bytes = static_cast<std::uint32_t>(pad);
    filler.kind = static_cast<std::uint16_t>(proto::TaskKind::kPadding);
    filler.format_version = proto::kPaddingFormat;
    // The tail can be 16..48 bytes (positions and sizes are multiples of 16, the header is 64):
    // only record_bytes, kind and format_version are read from a padding record, and all three
    // lie in its first 12 bytes.
    std::memcpy(ring_ + pos, &filler, pad < sizeof filler ? pad : sizeof filler);
  }
  std::byte* at = ring_ + (head + pad) % cap_;
  proto::TaskRecordHeader hdr = hdr_in;
  hdr.seq = h_->next_seq.load(std::memory_order_relaxed);
  write_task_record(at, hdr, src, dst, events);  // the one encoder of the wire format (task_codec.h)

  h_->next_seq.store(hdr.seq + 1, std::memory_order_relaxed);
  // Release publishes the padding and the record bytes written above to every reader that
  // acquires ring_head.
  h_->ring_head.store(head + pad + bytes, std::memory_order_release);
  if (seq_out) *seq_out = hdr.seq;
  return true;
}

TaskRingReader::Read TaskRingReader::try_pop(std::vector<std::byte>& out) {
  auto& slot = h_->ranks[rank_];
  for (;;) {
    const std::uint64_t tail = slot.consumed.load(std::memory_order_relaxed);  // only we write it
    // Acquire pairs with the writer's release of ring_head: the bytes below head are complete.
    const std::uint64_t head = h_->ring_head.load(std::memory_order_acquire);
    if (tail == head) return Read::kEmpty;
    if (head - tail > cap_ || tail % proto::kRecordAlign != 0) return Read::kCorrupt;
    const std::uint64_t pos = tail % cap_;
    const std::uint64_t contiguous = cap_ - pos;
    std::uint32_t rb = 0;
    std::uint16_t kind = 0;
    std::uint32_t format = 0;
    std::memcpy(&rb, ring_ + pos, sizeof rb);
    std::memcpy(&kind, ring_ + pos + 4, sizeof kind);
    std::memcpy(&format, ring_ + pos + 8, sizeof format);
    if (rb == 0 || rb % proto::kRecordAlign != 0 || rb > contiguous || rb > head - tail) return Read::kCorrupt;
    if (kind == static_cast<std::uint16_t>(proto::TaskKind::kPadding) && format == proto::kPaddingFormat) {
      // Padding only ever fills the rest of the buffer; anywhere else the framing is broken.
      if (rb != contiguous || pos == 0) return Read::kCorrupt;
      // Release: we read nothing of these bytes that the producer may not overwrite now.
      slot.consumed.store(tail + rb, std::memory_order_release);
      continue;
    }
    if (rb < sizeof(proto::TaskRecordHeader)) return Read::kCorrupt;
    out.resize(rb);
    std::memcpy(out.data(), ring_ + pos, rb);
    // Release after the copy: the producer (acquire in min_consumed) may overwrite these bytes
    // only once they are in `out`.
    slot.consumed.store(tail + rb, std::memory_order_release);
    return Read::kRecord;
  }
}

bool CompletionRing::try_push(const proto::CompletionRecord& rec) {
  const std::uint64_t head = c_->head.load(std::memory_order_relaxed);
  // Acquire pairs with the consumer's release of tail: the slot we are about to reuse was copied.
  const std::uint64_t tail = c_->tail.load(std::memory_order_acquire);
  if (head - tail >= cap_) return false;  // also when a broken tail is ahead of head
  std::memcpy(&r_[head % cap_], &rec, sizeof rec);
  // Release publishes the record written above to the consumer's acquire of head.
  c_->head.store(head + 1, std::memory_order_release);
  return true;
}

bool CompletionRing::try_pop(proto::CompletionRecord& rec) {
  const std::uint64_t tail = c_->tail.load(std::memory_order_relaxed);  // only we write it
  // Acquire pairs with the producer's release of head: the record below head is complete.
  const std::uint64_t head = c_->head.load(std::memory_order_acquire);
  if (tail == head) return false;
  if (head - tail > cap_) {
    // A producer that claims more records than the ring holds is broken or hostile: skip to its
    // head rather than read slots twice. The lost reports fail by rank liveness, never silently.
    c_->tail.store(head, std::memory_order_release);
    return false;
  }
  std::memcpy(&rec, &r_[tail % cap_], sizeof rec);
  // Release after the copy: the producer may reuse the slot once we no longer read it.
  c_->tail.store(tail + 1, std::memory_order_release);
  return true;
}

}  // namespace kvtd::ipc
