#include "kvtd/ipc/rings.h"

#include <cstring>

namespace kvtd::ipc {
namespace {

// The lowest cursor among ranks the engine counts as attached; the producer may not write past
// it + capacity. With no attached rank, nothing is left to protect.
std::uint64_t min_consumed(const proto::SessionHeader& h, std::uint64_t head) {
  std::uint64_t lo = head;
  const std::uint32_t n = h.geometry.num_ranks < proto::kMaxRanks ? h.geometry.num_ranks : proto::kMaxRanks;
  for (std::uint32_t r = 0; r < n; ++r) {
    if (h.ranks[r].attached.load(std::memory_order_acquire) == 0) continue;
    const std::uint64_t c = h.ranks[r].consumed.load(std::memory_order_acquire);
    if (c < lo) lo = c;
  }
  return lo;
}

}  // namespace

bool TaskRingWriter::fits(std::uint64_t num_src, std::uint64_t num_dst) const {
  const std::uint64_t bytes = sizeof(proto::TaskRecordHeader) + 4 * (num_src + num_dst) + proto::kRecordAlign;
  return num_src < (1u << 30) && num_dst < (1u << 30) && bytes <= cap_ / 2;
}

std::uint64_t TaskRingWriter::free_bytes() const {
  const std::uint64_t head = h_->ring_head.load(std::memory_order_relaxed);
  const std::uint64_t used = head - min_consumed(*h_, head);
  return used >= cap_ ? 0 : cap_ - used;
}

bool TaskRingWriter::try_push(const proto::TaskRecordHeader& hdr_in, std::span<const std::int32_t> src,
                              std::span<const std::int32_t> dst, std::uint64_t* seq_out) {
  const auto num_src = static_cast<std::uint32_t>(src.size());
  const auto num_dst = static_cast<std::uint32_t>(dst.size());
  const std::uint32_t bytes = proto::task_record_bytes(num_src, num_dst);
  const std::uint64_t head = h_->ring_head.load(std::memory_order_relaxed);
  const std::uint64_t pos = head % cap_;
  const std::uint64_t contiguous = cap_ - pos;
  const std::uint64_t pad = bytes > contiguous ? contiguous : 0;
  if (free_bytes() < pad + bytes) return false;

  if (pad != 0) {
    proto::TaskRecordHeader filler{};
    filler.record_bytes = static_cast<std::uint32_t>(pad);
    filler.kind = static_cast<std::uint16_t>(proto::TaskKind::kPadding);
    filler.format_version = proto::kTaskFormatVersion;
    // A tail shorter than a header cannot occur: positions and sizes are multiples of 16 and the
    // header is 64 bytes, but the tail can be 16..48 bytes. Only record_bytes and kind are read
    // from a padding record, and both lie in its first 8 bytes.
    std::memcpy(ring_ + pos, &filler, pad < sizeof filler ? pad : sizeof filler);
  }
  std::byte* at = ring_ + (head + pad) % cap_;
  proto::TaskRecordHeader hdr = hdr_in;
  hdr.record_bytes = bytes;
  hdr.num_src = num_src;
  hdr.num_dst = num_dst;
  hdr.seq = h_->next_seq.load(std::memory_order_relaxed);
  std::memcpy(at, &hdr, sizeof hdr);
  if (num_src) std::memcpy(at + sizeof hdr, src.data(), 4ull * num_src);
  if (num_dst) std::memcpy(at + sizeof hdr + 4ull * num_src, dst.data(), 4ull * num_dst);

  h_->next_seq.store(hdr.seq + 1, std::memory_order_relaxed);
  h_->ring_head.store(head + pad + bytes, std::memory_order_release);
  if (seq_out) *seq_out = hdr.seq;
  return true;
}

TaskRingReader::Read TaskRingReader::try_pop(std::vector<std::byte>& out) {
  auto& slot = h_->ranks[rank_];
  for (;;) {
    const std::uint64_t tail = slot.consumed.load(std::memory_order_relaxed);
    const std::uint64_t head = h_->ring_head.load(std::memory_order_acquire);
    if (tail == head) return Read::kEmpty;
    if (head - tail > cap_ || tail % proto::kRecordAlign != 0) return Read::kCorrupt;
    const std::uint64_t pos = tail % cap_;
    const std::uint64_t contiguous = cap_ - pos;
    std::uint32_t rb = 0;
    std::uint16_t kind = 0;
    std::memcpy(&rb, ring_ + pos, sizeof rb);
    std::memcpy(&kind, ring_ + pos + 4, sizeof kind);
    if (rb == 0 || rb % proto::kRecordAlign != 0 || rb > contiguous || rb > head - tail) return Read::kCorrupt;
    if (kind == static_cast<std::uint16_t>(proto::TaskKind::kPadding) && rb == contiguous && pos != 0) {
      slot.consumed.store(tail + rb, std::memory_order_release);
      continue;
    }
    if (rb < sizeof(proto::TaskRecordHeader)) return Read::kCorrupt;
    out.resize(rb);
    std::memcpy(out.data(), ring_ + pos, rb);
    slot.consumed.store(tail + rb, std::memory_order_release);
    return Read::kRecord;
  }
}

bool CompletionRing::try_push(const proto::CompletionRecord& rec) {
  const std::uint64_t head = c_->head.load(std::memory_order_relaxed);
  const std::uint64_t tail = c_->tail.load(std::memory_order_acquire);
  if (head - tail >= cap_) return false;
  std::memcpy(&r_[head % cap_], &rec, sizeof rec);
  c_->head.store(head + 1, std::memory_order_release);
  return true;
}

bool CompletionRing::try_pop(proto::CompletionRecord& rec) {
  const std::uint64_t tail = c_->tail.load(std::memory_order_relaxed);
  const std::uint64_t head = c_->head.load(std::memory_order_acquire);
  if (tail == head) return false;
  std::memcpy(&rec, &r_[tail % cap_], sizeof rec);
  c_->tail.store(tail + 1, std::memory_order_release);
  return true;
}

}  // namespace kvtd::ipc
