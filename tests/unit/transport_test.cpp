// transport/: block headers (encoder beside parser, hostile input) and two UCX Links in one
// process: granted blocks arrive whole and verified; anything else is dropped with nothing
// written, named; a source changed while in flight fails the block's checksum; an expired or
// revoked grant takes nothing; a closed peer fails its sender's sends.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <xxhash.h>

#include "kvtd/transport/block_header.h"
#include "kvtd/transport/head_plan.h"
#include "kvtd/transport/leases.h"
#include "kvtd/transport/link.h"

namespace kvtd::transport {
namespace {

using Kind = LinkEvent::Kind;

TEST(BlockHeaderTest, EncodesAndParsesBackEveryField) {
  const BlockHeader h{0x1122334455667788ULL, 77, 2u << 20, 0xdeadbeefcafef00dULL};
  const auto wire = encode_block_header(h);
  auto back = parse_block_header(wire);
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back->grant, h.grant);
  EXPECT_EQ(back->index, h.index);
  EXPECT_EQ(back->length, h.length);
  EXPECT_EQ(back->checksum, h.checksum);
}

TEST(BlockHeaderTest, TheChecksumIsPlainXxh3WhicheverCodeComputesIt) {
  // The sender's and the receiver's builds may pick different XXH3 code (runtime dispatch on
  // x86): the value on the wire must be XXH3-64 itself.
  std::vector<std::byte> bytes(100'003);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i * 7 + 3);
  EXPECT_EQ(block_checksum(bytes), XXH3_64bits(bytes.data(), bytes.size()));
}

TEST(BlockHeaderTest, RefusesWhatIsNotAHeaderNamingWhy) {
  auto wire = encode_block_header({1, 2, 3, 4});
  EXPECT_NE(parse_block_header(std::span(wire).first(39)).error().message.find("40 bytes"), std::string::npos);
  auto bad = wire;
  bad[0] = std::byte{0};
  EXPECT_NE(parse_block_header(bad).error().message.find("magic"), std::string::npos);
  bad = wire;
  bad[4] = std::byte{9};
  EXPECT_NE(parse_block_header(bad).error().message.find("version 9"), std::string::npos);
  bad = wire;
  bad[12] = std::byte{1};
  EXPECT_EQ(parse_block_header(bad).error().code, TransportErrc::kMalformed);
}

// Heterogeneous TP: which heads a decode rank reads from which prefill ranks.
struct PlanCase {
  HeadLayout from, to;
  std::uint32_t dest;
  std::vector<HeadRun> want;
};

bool same_runs(const std::vector<HeadRun>& a, const std::vector<HeadRun>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const HeadRun& x, const HeadRun& y) {
           return x.source_rank == y.source_rank && x.source_head == y.source_head && x.dest_head == y.dest_head &&
                  x.heads == y.heads;
         });
}

TEST(HeadPlanTest, SplitsAndMergesHeadsAcrossTpSizes) {
  const std::vector<PlanCase> cases = {
      {{2, 8}, {1, 8}, 0, {{0, 0, 0, 4}, {1, 0, 4, 4}}},         // TP 2 -> 1: merge
      {{2, 8}, {4, 8}, 1, {{0, 2, 0, 2}}},                       // TP 2 -> 4: split
      {{2, 8}, {4, 8}, 2, {{1, 0, 0, 2}}},
      {{4, 8}, {2, 8}, 1, {{2, 0, 0, 2}, {3, 0, 2, 2}}},         // TP 4 -> 2
      {{4, 2}, {1, 2}, 0, {{0, 0, 0, 1}, {2, 0, 1, 1}}},         // GQA, heads replicated at the source
      {{1, 2}, {4, 2}, 3, {{0, 1, 0, 1}}},                       // and at the destination
      {{2, 8, true}, {4, 8, true}, 3, {{1, 0, 0, 1}}},           // MLA: the whole latent, spread
      {{2, 8, true}, {1, 8, true}, 0, {{0, 0, 0, 1}}},
  };
  for (const auto& c : cases) {
    auto got = heads_from(c.from, c.to, c.dest);
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_TRUE(same_runs(*got, c.want)) << "TP " << c.from.ranks << " -> " << c.to.ranks << " heads " << c.from.kv_heads
                                         << " dest " << c.dest;
  }
}

TEST(HeadPlanTest, EveryDestinationHeadComesOnceFromARankHoldingIt) {
  for (std::uint32_t heads : {1u, 2u, 4u, 8u, 16u})
    for (std::uint32_t p : {1u, 2u, 4u, 8u})
      for (std::uint32_t d : {1u, 2u, 4u, 8u}) {
        const HeadLayout from{p, heads}, to{d, heads};
        for (std::uint32_t dest = 0; dest < d; ++dest) {
          auto runs = heads_from(from, to, dest);
          ASSERT_TRUE(runs.ok()) << runs.error().message;
          std::vector<int> seen(heads_per_rank(to), 0);
          const auto dest_first = heads >= d ? dest * (heads / d) : dest * heads / d;
          for (const auto& r : *runs)
            for (std::uint32_t i = 0; i < r.heads; ++i) {
              ++seen.at(r.dest_head + i);
              ASSERT_LT(r.source_head + i, heads_per_rank(from));
              const auto src_global = heads >= p ? r.source_rank * (heads / p) + r.source_head + i
                                                 : r.source_rank * heads / p;
              EXPECT_EQ(src_global, dest_first + r.dest_head + i) << p << "->" << d << " heads " << heads;
            }
          EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
        }
      }
}

TEST(HeadPlanTest, RefusesLayoutsThatCannotMeetNamingWhy) {
  EXPECT_NE(heads_from({4, 6}, {2, 6}, 0).error().message.find("6 KV heads on 4 ranks"), std::string::npos);
  EXPECT_NE(heads_from({2, 8}, {2, 4}, 0).error().message.find("prefill has 8 KV heads, decode 4"), std::string::npos);
  EXPECT_NE(heads_from({2, 8, true}, {2, 8}, 0).error().message.find("replicated"), std::string::npos);
  EXPECT_NE(heads_from({2, 8}, {2, 8}, 2).error().message.find("decode rank 2 of 2"), std::string::npos);
}

// The prefill side's leases: held until confirmed, extended by heartbeats, freed when they end,
// never while a transfer of them is in flight; a dead peer's end at once.
TEST(LeasesTest, HeldUntilConfirmedOrTheLeaseEndsAndNeverFreedUnderATransfer) {
  Leases l(30'000);
  ASSERT_TRUE(l.hold(1, 7, {4, 5}, 0).ok());
  ASSERT_TRUE(l.hold(2, 7, {6}, 0).ok());
  ASSERT_TRUE(l.hold(3, 8, {9}, 0).ok());
  EXPECT_NE(l.hold(1, 7, {1}, 0).error().message.find("held already"), std::string::npos);
  EXPECT_EQ(l.hold(4, 7, {}, 0).error().code, TransportErrc::kInvalidArgument);
  EXPECT_EQ(l.release(2), (std::vector<std::int32_t>{6}));  // the decode side has it
  EXPECT_TRUE(l.release(2).empty());
  l.heartbeat(7, 25'000);  // peer 7 still waits: its lease lasts to 45 000
  l.transfer_started(3);
  EXPECT_TRUE(l.expire(29'999).empty());
  EXPECT_TRUE(l.expire(30'000).empty()) << "peer 8's lease ended, but its transfer is in flight";
  EXPECT_EQ(l.overdue(30'000), (std::vector<std::uint64_t>{3}));
  l.transfer_ended(3);
  auto freed = l.expire(30'000);
  ASSERT_EQ(freed.size(), 1u);
  EXPECT_EQ(freed[0].request, 3u);
  EXPECT_TRUE(l.expire(44'999).empty());
  freed = l.expire(45'000);
  ASSERT_EQ(freed.size(), 1u);
  EXPECT_EQ(freed[0].blocks, (std::vector<std::int32_t>{4, 5}));
  ASSERT_TRUE(l.hold(5, 9, {1}, 50'000).ok());
  l.peer_failed(9, 51'000);  // the decode daemon died: no waiting out the lease
  EXPECT_EQ(l.expire(51'000).size(), 1u);
  EXPECT_EQ(l.held(), 0u);
}

// Two Links joined both ways, a clock the test moves, and a loop that progresses both.
class LinkPair : public ::testing::Test {
 protected:
  void SetUp() override {
    LinkOptions o;
    o.now_ns = [this] { return now_; };
    auto a = Link::open(o);
    ASSERT_TRUE(a.ok()) << a.error().message;
    auto b = Link::open(o);
    ASSERT_TRUE(b.ok()) << b.error().message;
    sender_ = std::move(a).value();
    receiver_ = std::move(b).value();
    auto peer = sender_->connect(receiver_->address());
    ASSERT_TRUE(peer.ok()) << peer.error().message;
    peer_ = *peer;
  }

  // Progresses both until `done` holds (or 10 s pass); returns every event seen.
  template <typename Done>
  std::vector<LinkEvent> run_until(Done done) {
    std::vector<LinkEvent> out;
    for (int i = 0; i < 1'000'000 && !done(out); ++i) {
      sender_->progress(out);
      receiver_->progress(out);
    }
    return out;
  }

  static std::size_t count(const std::vector<LinkEvent>& ev, Kind k) {
    return static_cast<std::size_t>(std::count_if(ev.begin(), ev.end(), [k](const LinkEvent& e) { return e.kind == k; }));
  }

  static std::vector<std::byte> random_bytes(std::size_t n, unsigned seed) {
    std::vector<std::byte> v(n);
    std::mt19937 rng(seed);
    for (auto& b : v) b = static_cast<std::byte>(rng());
    return v;
  }

  std::int64_t now_ = 1'000;
  std::unique_ptr<Link> sender_, receiver_;
  std::uint64_t peer_ = 0;
};

TEST_F(LinkPair, GrantedBlocksOfEverySizeArriveWholeAndVerified) {
  const std::vector<std::size_t> sizes = {64, 4096, 8192, 64 << 10, 1 << 20};  // eager and zero-copy
  std::vector<std::vector<std::byte>> src, dst;
  std::vector<std::span<std::byte>> blocks;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(random_bytes(sizes[i], static_cast<unsigned>(i + 1)));
    dst.emplace_back(sizes[i]);
  }
  for (auto& d : dst) blocks.emplace_back(d);
  ASSERT_TRUE(receiver_->grant(42, blocks, now_ + 1'000'000'000).ok());
  for (std::uint32_t i = 0; i < sizes.size(); ++i) ASSERT_TRUE(sender_->send_block(peer_, 42, i, src[i]).ok());
  auto ev = run_until([&](const auto&) { return receiver_->received(42) == sizes.size() && sender_->sends_in_flight() == 0; });
  EXPECT_EQ(count(ev, Kind::kReceived), sizes.size());
  EXPECT_EQ(count(ev, Kind::kSent), sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(src[i], dst[i]) << "block " << i;
}

TEST_F(LinkPair, BlocksForNoGrantOutsideItTwiceOrOfTheWrongSizeAreDroppedNamedAndNothingIsWritten) {
  std::vector<std::byte> d0(64 << 10, std::byte{0}), d1(64 << 10, std::byte{0});
  ASSERT_TRUE(receiver_->grant(7, {d0, d1}, now_ + 1'000'000'000).ok());
  const auto big = random_bytes(64 << 10, 3), small = random_bytes(512, 4), wrong = random_bytes(32 << 10, 5);
  ASSERT_TRUE(sender_->send_block(peer_, 99, 0, big).ok());    // no such grant
  ASSERT_TRUE(sender_->send_block(peer_, 7, 2, big).ok());     // outside it
  ASSERT_TRUE(sender_->send_block(peer_, 7, 1, wrong).ok());   // not the block's size
  ASSERT_TRUE(sender_->send_block(peer_, 7, 0, small).ok());   // not the block's size, eager
  auto ev = run_until([&](const auto& e) { return count(e, Kind::kRejected) == 4 && sender_->sends_in_flight() == 0; });
  ASSERT_EQ(count(ev, Kind::kRejected), 4u);
  std::string why;
  for (const auto& e : ev)
    if (e.kind == Kind::kRejected) why += e.message + "\n";
  EXPECT_NE(why.find("no live grant 99"), std::string::npos) << why;
  EXPECT_NE(why.find("grant 7 has 2 blocks; the peer named block 2"), std::string::npos) << why;
  EXPECT_NE(why.find("block 1 of grant 7 is 65536 bytes; the peer sent 32768"), std::string::npos) << why;
  EXPECT_EQ(count(ev, Kind::kSendFailed), 3u) << "a rejected zero-copy send fails on its sender's side";
  EXPECT_TRUE(std::all_of(d0.begin(), d0.end(), [](std::byte b) { return b == std::byte{0}; }));
  EXPECT_TRUE(std::all_of(d1.begin(), d1.end(), [](std::byte b) { return b == std::byte{0}; }));
  // Received once, a block is not written again.
  ASSERT_TRUE(sender_->send_block(peer_, 7, 0, big).ok());
  run_until([&](const auto&) { return receiver_->received(7) == 1 && sender_->sends_in_flight() == 0; });
  const auto other = random_bytes(64 << 10, 6);
  ASSERT_TRUE(sender_->send_block(peer_, 7, 0, other).ok());
  ev = run_until([&](const auto& e) { return count(e, Kind::kRejected) == 1 && sender_->sends_in_flight() == 0; });
  EXPECT_NE(ev.front().message.find("written already"), std::string::npos);
  EXPECT_EQ(d0, big);
}

TEST_F(LinkPair, ASourceChangedBeforeThePeerReadItFailsTheBlocksChecksumNamingIt) {
  std::vector<std::byte> d(256 << 10);
  ASSERT_TRUE(receiver_->grant(5, {d}, now_ + 1'000'000'000).ok());
  auto src = random_bytes(256 << 10, 8);
  ASSERT_TRUE(sender_->send_block(peer_, 5, 0, src).ok());  // zero-copy: read when the peer pulls it
  src[1000] ^= std::byte{0xff};
  auto ev = run_until([&](const auto& e) { return count(e, Kind::kReceiveFailed) == 1; });
  ASSERT_EQ(count(ev, Kind::kReceiveFailed), 1u);
  const auto& e = *std::find_if(ev.begin(), ev.end(), [](const auto& x) { return x.kind == Kind::kReceiveFailed; });
  EXPECT_EQ(e.code, TransportErrc::kChecksumMismatch);
  EXPECT_NE(e.message.find("block 0 of grant 5: checksum"), std::string::npos) << e.message;
  EXPECT_EQ(receiver_->received(5), 0u);
}

TEST_F(LinkPair, AnExpiredOrRevokedGrantTakesNothing) {
  std::vector<std::byte> d(64 << 10, std::byte{0});
  ASSERT_TRUE(receiver_->grant(11, {d}, now_ + 500).ok());
  now_ += 500;  // the grant's deadline
  const auto src = random_bytes(64 << 10, 9);
  ASSERT_TRUE(sender_->send_block(peer_, 11, 0, src).ok());
  auto ev = run_until([&](const auto& e) { return count(e, Kind::kRejected) == 1 && sender_->sends_in_flight() == 0; });
  EXPECT_NE(ev.front().message.find("grant 11 has expired"), std::string::npos) << ev.front().message;
  ASSERT_TRUE(receiver_->grant(12, {d}, now_ + 1'000'000).ok());
  ASSERT_TRUE(receiver_->revoke(12).ok());
  ASSERT_TRUE(sender_->send_block(peer_, 12, 0, src).ok());
  ev = run_until([&](const auto& e) { return count(e, Kind::kRejected) == 1 && sender_->sends_in_flight() == 0; });
  EXPECT_NE(ev.front().message.find("no live grant 12"), std::string::npos) << ev.front().message;
  EXPECT_TRUE(std::all_of(d.begin(), d.end(), [](std::byte b) { return b == std::byte{0}; }));
}

TEST_F(LinkPair, AfterRevokeReturnsNothingMoreIsWrittenIntoTheGrantsBlocks) {
  std::vector<std::byte> d(8 << 20, std::byte{0});
  ASSERT_TRUE(receiver_->grant(31, {d}, now_ + 1'000'000'000).ok());
  const auto src = random_bytes(8 << 20, 11);
  ASSERT_TRUE(sender_->send_block(peer_, 31, 0, src).ok());
  std::vector<LinkEvent> ev;
  // Until the receiver has taken the block and its pull is under way (or done).
  for (int i = 0; i < 100'000 && receiver_->receives_in_flight() == 0 && receiver_->received(31) == 0; ++i) {
    sender_->progress(ev);
    receiver_->progress(ev);
  }
  // The sender is another process in a deployment: it goes on serving the pull while the
  // receiver revokes (a Link is one thread's; the two Links are independent).
  std::atomic<bool> revoking_done{false}, peer_done{false};
  std::thread peer([&] {  // the sender's thread alone touches it from here until the join
    std::vector<LinkEvent> mine;
    for (int i = 0; i < 2'000'000 && (!revoking_done.load() || sender_->sends_in_flight() != 0); ++i)
      sender_->progress(mine);
    peer_done = true;
  });
  const auto revoked = receiver_->revoke(31);
  revoking_done = true;
  const auto at_revoke = d;
  const auto left = receiver_->receives_in_flight();
  while (!peer_done.load()) receiver_->progress(ev);  // the sender's send ends (failed or not)
  peer.join();
  ASSERT_TRUE(revoked.ok()) << revoked.error().message;
  EXPECT_EQ(left, 0u);
  EXPECT_EQ(d, at_revoke) << "bytes were written into a revoked grant's block";
  EXPECT_EQ(receiver_->received(31), 0u) << "a revoked grant reports nothing received";
}

TEST_F(LinkPair, GrantsAreRefusedWhenTheyCannotBeHonoured) {
  std::vector<std::byte> d(16);
  EXPECT_EQ(receiver_->grant(0, {d}, now_ + 1).error().code, TransportErrc::kInvalidArgument);
  EXPECT_EQ(receiver_->grant(3, {}, now_ + 1).error().code, TransportErrc::kInvalidArgument);
  ASSERT_TRUE(receiver_->grant(3, {d}, now_ + 1).ok());
  EXPECT_NE(receiver_->grant(3, {d}, now_ + 1).error().message.find("grant 3 is in use"), std::string::npos);
  EXPECT_EQ(sender_->send_block(peer_ + 100, 3, 0, d).error().code, TransportErrc::kInvalidArgument);
}

TEST_F(LinkPair, AClosedPeerFailsItsSendersSendsWithinABound) {
  std::vector<std::byte> d(1 << 20);
  ASSERT_TRUE(receiver_->grant(21, {d}, now_ + 1'000'000'000).ok());
  receiver_.reset();  // the peer's process is gone
  const auto src = random_bytes(1 << 20, 10);
  std::vector<LinkEvent> ev;
  bool failed = false;
  for (int i = 0; i < 200 && !failed; ++i) {  // sends until one fails or the endpoint is reported failed
    auto r = sender_->send_block(peer_, 21, 0, src);
    failed = !r.ok();
    for (int j = 0; j < 20000 && !failed; ++j) {
      sender_->progress(ev);
      failed = count(ev, Kind::kSendFailed) + count(ev, Kind::kPeerFailed) > 0;
      if (sender_->sends_in_flight() == 0) break;
    }
  }
  EXPECT_TRUE(failed) << "sends to a peer that is gone never failed";
}

}  // namespace
}  // namespace kvtd::transport
