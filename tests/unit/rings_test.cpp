#include "kvtd/ipc/rings.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace kvtd::ipc {
namespace {

// A session header and ring on the heap: the ring logic does not care where memory lives.
struct RingFixture {
  std::unique_ptr<proto::SessionHeader> h = std::make_unique<proto::SessionHeader>();
  std::vector<std::byte> bytes;
  TaskRingWriter writer;
  RingFixture(std::uint64_t cap, std::uint32_t ranks)
      : bytes(cap), writer(h.get(), bytes.data(), cap, ranks) {
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

// A kind-0 task whose record ends exactly at the end of the buffer used to be
// skipped as padding, so it never completed and its in-flight slot leaked.
TEST(TaskRing, KindZeroRecordEndingAtTheRingEndIsDeliveredNotSkippedAsPadding) {
  RingFixture f(4096, 1);
  auto r0 = f.reader(0);
  std::vector<std::byte> rec;
  // 64 + 4 * 2 * 376 = 3072 bytes, then a 1024-byte kind-0 record that ends at exactly 4096.
  std::vector<std::int32_t> big(376, 1), tail(120, 2);
  ASSERT_TRUE(f.writer.try_push(header(1), big, big, nullptr));
  ASSERT_EQ(r0.try_pop(rec), TaskRingReader::Read::kRecord);
  auto h0 = header(2);
  h0.kind = 0;
  ASSERT_TRUE(f.writer.try_push(h0, tail, tail, nullptr));
  EXPECT_EQ(f.h->ring_head.load(), 4096u);
  ASSERT_EQ(r0.try_pop(rec), TaskRingReader::Read::kRecord);
  proto::TaskRecordHeader h;
  std::memcpy(&h, rec.data(), sizeof h);
  EXPECT_EQ(h.task_id, 2u);
  EXPECT_EQ(h.kind, 0u);
}

// The free-space check must count the padding a wrap needs: a lagging rank's unread record at
// the start of the buffer must survive a producer that wraps.
TEST(TaskRing, WrapWithALaggingRankNeverOverwritesItsUnreadRecords) {
  RingFixture f(4096, 2);
  auto r0 = f.reader(0), r1 = f.reader(1);
  std::vector<std::byte> rec;
  std::vector<std::int32_t> ids(200, 0);  // 64 + 1600 = 1664 bytes
  std::uint64_t next = 1, read1 = 0;
  for (int round = 0; round < 400; ++round) {
    for (auto& v : ids) v = static_cast<std::int32_t>(next);
    if (f.writer.try_push(header(next), ids, ids, nullptr)) ++next;
    while (r0.try_pop(rec) == TaskRingReader::Read::kRecord) {}
    if (round % 3 == 0) {  // rank 1 reads every third round only
      if (r1.try_pop(rec) == TaskRingReader::Read::kRecord) {
        proto::TaskRecordHeader h;
        std::memcpy(&h, rec.data(), sizeof h);
        ++read1;
        ASSERT_EQ(h.task_id, read1);
        std::int32_t first = 0;
        std::memcpy(&first, rec.data() + sizeof h, 4);
        ASSERT_EQ(first, static_cast<std::int32_t>(read1)) << "record " << read1 << " was overwritten";
      }
    }
  }
  EXPECT_GT(read1, 50u);
}

TEST(TaskRing, CursorClaimingToBeAheadOfHeadDoesNotFreeSpace) {
  RingFixture f(4096, 1);
  std::vector<std::int32_t> ids(40, 1);
  ASSERT_TRUE(f.writer.try_push(header(1), ids, ids, nullptr));
  f.h->ranks[0].consumed.store(1ull << 40);  // hostile or broken daemon
  EXPECT_EQ(f.writer.free_bytes(), 0u);
}

// One producer, several consumer threads (the ranks): TSan checks the acquire/release pairs, and
// every consumer checks every byte of every record.
TEST(TaskRing, ThreadedStressEveryConsumerSeesEveryRecordIntact) {
  constexpr std::uint32_t kRanks = 4;
  constexpr std::uint64_t kRecords = 20000;
  RingFixture f(8192, kRanks);
  std::atomic<bool> failed{false};
  std::vector<std::thread> consumers;
  for (std::uint32_t r = 0; r < kRanks; ++r) {
    consumers.emplace_back([&, r] {
      auto reader = f.reader(r);
      std::vector<std::byte> rec;
      std::uint64_t want = 1;
      while (want <= kRecords && !failed.load()) {
        if (reader.try_pop(rec) != TaskRingReader::Read::kRecord) {
          std::this_thread::yield();
          continue;
        }
        proto::TaskRecordHeader h;
        std::memcpy(&h, rec.data(), sizeof h);
        const auto src = ids_of(rec, false), dst = ids_of(rec, true);
        bool ok = h.task_id == want && src.size() == want % 23 && dst.size() == src.size();
        for (std::size_t i = 0; ok && i < src.size(); ++i)
          ok = src[i] == static_cast<std::int32_t>(want * 7 + i) && dst[i] == -src[i];
        if (!ok) failed.store(true);
        ++want;
      }
    });
  }
  for (std::uint64_t id = 1; id <= kRecords && !failed.load(); ++id) {
    std::vector<std::int32_t> src(id % 23), dst(id % 23);
    for (std::size_t i = 0; i < src.size(); ++i) {
      src[i] = static_cast<std::int32_t>(id * 7 + i);
      dst[i] = -src[i];
    }
    while (!f.writer.try_push(header(id), src, dst, nullptr)) std::this_thread::yield();
  }
  for (auto& t : consumers) t.join();
  EXPECT_FALSE(failed.load());
}

TEST(CompletionRing, ThreadedStressRecordsArriveInOrderIntact) {
  proto::CompletionRingControl ctl{};
  std::vector<proto::CompletionRecord> recs(16);
  CompletionRing ring(&ctl, recs.data(), 16);
  constexpr std::uint64_t kRecords = 50000;
  std::thread producer([&] {
    proto::CompletionRecord r{};
    for (std::uint64_t i = 0; i < kRecords; ++i) {
      r.task_id = i;
      r.blocks_done = i * 3;
      std::memset(r.message, static_cast<int>('a' + i % 26), sizeof r.message - 1);
      while (!ring.try_push(r)) std::this_thread::yield();
    }
  });
  proto::CompletionRecord r{};
  for (std::uint64_t i = 0; i < kRecords; ++i) {
    while (!ring.try_pop(r)) std::this_thread::yield();
    ASSERT_EQ(r.task_id, i);
    ASSERT_EQ(r.blocks_done, i * 3);
    ASSERT_EQ(r.message[0], static_cast<char>('a' + i % 26));
    ASSERT_EQ(r.message[sizeof r.message - 2], static_cast<char>('a' + i % 26));
  }
  producer.join();
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
