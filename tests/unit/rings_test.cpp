#include "kvtd/ipc/rings.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

namespace kvtd::ipc {
namespace {

// A session header and ring on the heap: the ring logic does not care where memory lives.
struct RingFixture {
  std::unique_ptr<proto::SessionHeader> h = std::make_unique<proto::SessionHeader>();
  std::vector<std::byte> bytes;
  TaskRingWriter writer;
  RingFixture(std::uint64_t cap, std::uint32_t ranks)
      : bytes(cap), writer(h.get(), bytes.data(), cap) {
    h->geometry.num_ranks = ranks;
    for (std::uint32_t r = 0; r < ranks; ++r) h->ranks[r].attached.store(1);
  }
  TaskRingReader reader(std::uint32_t r) { return TaskRingReader(h.get(), bytes.data(), bytes.size(), r); }
};

proto::TaskRecordHeader header(std::uint64_t id) {
  proto::TaskRecordHeader hdr{};
  hdr.kind = static_cast<std::uint16_t>(proto::TaskKind::kSwapToHost);
  hdr.format_version = proto::kTaskFormatVersion;
  hdr.task_id = id;
  return hdr;
}

std::vector<std::int32_t> ids_of(const std::vector<std::byte>& rec, bool dst) {
  proto::TaskRecordHeader h;
  std::memcpy(&h, rec.data(), sizeof h);
  std::vector<std::int32_t> out(dst ? h.num_dst : h.num_src);
  if (!out.empty()) std::memcpy(out.data(), rec.data() + sizeof h + (dst ? 4 * h.num_src : 0), 4 * out.size());
  return out;
}

TEST(TaskRing, EveryRankReceivesEveryRecordInOrderAcrossWraps) {
  RingFixture f(4096, 2);
  auto r0 = f.reader(0), r1 = f.reader(1);
  std::vector<std::byte> rec;
  for (std::uint64_t id = 1; id <= 500; ++id) {
    std::vector<std::int32_t> src(id % 37), dst(id % 37);
    for (std::size_t i = 0; i < src.size(); ++i) {
      src[i] = static_cast<std::int32_t>(id + i);
      dst[i] = static_cast<std::int32_t>(2 * id + i);
    }
    ASSERT_TRUE(f.writer.try_push(header(id), src, dst, nullptr)) << id;
    for (auto* r : {&r0, &r1}) {
      ASSERT_EQ(r->try_pop(rec), TaskRingReader::Read::kRecord);
      proto::TaskRecordHeader h;
      std::memcpy(&h, rec.data(), sizeof h);
      EXPECT_EQ(h.task_id, id);
      EXPECT_EQ(h.seq, id - 1);
      EXPECT_EQ(ids_of(rec, false), src);
      EXPECT_EQ(ids_of(rec, true), dst);
      EXPECT_EQ(r->try_pop(rec), TaskRingReader::Read::kEmpty);
    }
  }
}

TEST(TaskRing, FullRingRefusesInsteadOfOverwritingALaggingRank) {
  RingFixture f(4096, 2);
  auto r0 = f.reader(0);
  std::vector<std::int32_t> ids(40, 1);  // 64 + 320 = 384 bytes per record
  std::vector<std::byte> rec;
  int pushed = 0;
  while (f.writer.try_push(header(static_cast<std::uint64_t>(pushed + 1)), ids, ids, nullptr)) {
    ++pushed;
    while (r0.try_pop(rec) == TaskRingReader::Read::kRecord) {}  // rank 0 keeps up, rank 1 does not
    ASSERT_LT(pushed, 100);
  }
  EXPECT_EQ(pushed, 4096 / 384);
  // Rank 1 still reads its oldest record intact.
  auto r1 = f.reader(1);
  ASSERT_EQ(r1.try_pop(rec), TaskRingReader::Read::kRecord);
  proto::TaskRecordHeader h;
  std::memcpy(&h, rec.data(), sizeof h);
  EXPECT_EQ(h.task_id, 1u);
  // Once rank 1 consumed one record there is room again.
  EXPECT_TRUE(f.writer.try_push(header(99), ids, ids, nullptr));
}

TEST(TaskRing, DetachedRankDoesNotHoldSpace) {
  RingFixture f(4096, 2);
  f.h->ranks[1].attached.store(0);
  auto r0 = f.reader(0);
  std::vector<std::int32_t> ids(40, 1);
  std::vector<std::byte> rec;
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(f.writer.try_push(header(static_cast<std::uint64_t>(i + 1)), ids, ids, nullptr));
    ASSERT_EQ(r0.try_pop(rec), TaskRingReader::Read::kRecord);
  }
}

TEST(TaskRing, OversizedRecordDoesNotFit) {
  RingFixture f(4096, 1);
  EXPECT_TRUE(f.writer.fits(100, 100));
  EXPECT_FALSE(f.writer.fits(300, 300));
}

TEST(TaskRing, BrokenFramingIsReportedAsCorrupt) {
  RingFixture f(4096, 1);
  std::vector<std::int32_t> ids{1, 2};
  ASSERT_TRUE(f.writer.try_push(header(1), ids, ids, nullptr));
  std::uint32_t bogus = 13;  // not a multiple of the record alignment
  std::memcpy(f.bytes.data(), &bogus, sizeof bogus);
  std::vector<std::byte> rec;
  EXPECT_EQ(f.reader(0).try_pop(rec), TaskRingReader::Read::kCorrupt);
}

TEST(CompletionRing, FifoAndFull) {
  proto::CompletionRingControl ctl{};
  std::vector<proto::CompletionRecord> recs(4);
  CompletionRing ring(&ctl, recs.data(), 4);
  proto::CompletionRecord r{};
  for (std::uint64_t i = 0; i < 4; ++i) {
    r.task_id = i;
    ASSERT_TRUE(ring.try_push(r));
  }
  EXPECT_FALSE(ring.try_push(r));
  for (std::uint64_t i = 0; i < 4; ++i) {
    ASSERT_TRUE(ring.try_pop(r));
    EXPECT_EQ(r.task_id, i);
  }
  EXPECT_FALSE(ring.try_pop(r));
}

}  // namespace
}  // namespace kvtd::ipc
