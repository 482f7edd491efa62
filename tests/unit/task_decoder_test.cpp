// The dispatcher's task decoder (daemon/serve/task_decoder.h) in-process: records built with
// the wire format's one encoder (kvtd/ipc/task_codec.h), decoded against a small cache shape.
#include "task_decoder.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kvtd/ipc/task_codec.h"

namespace kvtd::daemon {
namespace {

using proto::TaskKind;
using proto::TaskStatus;
using Action = DecodedRecord::Action;

const std::vector<std::uint64_t> kBlockBytes{64, 64};
const GroupShape kOneGroup[] = {{0, 16, 0, 8, kBlockBytes}};
const CacheShape kShape{16, 8, kOneGroup};  // 16 device blocks, 8 host blocks

// Two cache groups side by side (kvtd/proto/group_slots.h): device ids 0-15 and 16-19, host ids
// 0-7 and 8-13.
const std::vector<std::uint64_t> kStateBytes{4096};
const GroupShape kTwoGroups[] = {{0, 16, 0, 8, kBlockBytes}, {16, 4, 8, 6, kStateBytes}};
CacheShape two_groups() {
  CacheShape s{20, 14, kTwoGroups};
  s.group_session = true;
  return s;
}

std::vector<std::byte> record(TaskKind kind, std::vector<std::int32_t> src, std::vector<std::int32_t> dst,
                              std::uint16_t flags = 0, std::uint32_t num_keys = 0, std::int64_t deadline = 0) {
  proto::TaskRecordHeader h{};
  h.kind = static_cast<std::uint16_t>(kind);
  h.format_version = proto::kTaskFormatVersion;
  h.flags = flags;
  h.num_keys = num_keys;
  h.deadline_ns = deadline;
  h.task_id = 42;
  return ipc::encode_task_record(h, src, dst);
}

std::vector<std::int32_t> section(std::vector<std::string> keys, std::uint64_t cancel = 0) {
  proto::StorageTaskArgs a{};
  a.cancel_task_id = cancel;
  return ipc::encode_storage_section(a, keys);
}

TEST(TaskDecoder, ASwapBecomesAPlanWithItsBlocksOnEachSide) {
  auto d = decode_record(record(TaskKind::kSwapToHost, {1, 2}, {3, 4}), kShape, 0);
  ASSERT_EQ(d.action, Action::kRun) << d.message;
  ASSERT_EQ(d.work.parts.size(), 1u);
  EXPECT_EQ(d.work.parts[0].plan.num_blocks, 2);
  EXPECT_EQ(d.work.device_ids, (std::vector<std::int32_t>{1, 2}));
  EXPECT_EQ(d.work.host_ids, (std::vector<std::int32_t>{3, 4}));
  EXPECT_EQ(d.work.header.task_id, 42u);
}

TEST(TaskDecoder, AnIdOutsideItsSideFailsNamingTheSides) {
  auto d = decode_record(record(TaskKind::kSwapToHost, {1}, {8}), kShape, 0);  // host has 8 blocks
  ASSERT_EQ(d.action, Action::kFail);
  EXPECT_EQ(d.status, TaskStatus::kIdOutOfRange);
  EXPECT_NE(d.message.find("destination: host blocks"), std::string::npos) << d.message;
  EXPECT_FALSE(d.abort_agreement);
}

TEST(TaskDecoder, APassedDeadlineFailsBeforeAnythingRuns) {
  auto d = decode_record(record(TaskKind::kSwapToDevice, {1}, {2}, 0, 0, 1000), kShape, 5'000'000);
  ASSERT_EQ(d.action, Action::kFail);
  EXPECT_EQ(d.status, TaskStatus::kDeadlineExceeded);
}

// Engine events (kTaskFlagEngineEvent): one 64-byte handle per rank after the ids; each rank
// keeps its own, copied out of the record.
std::vector<std::byte> with_events(TaskKind kind, std::size_t ranks) {
  proto::TaskRecordHeader h{};
  h.kind = static_cast<std::uint16_t>(kind);
  h.format_version = proto::kTaskFormatVersion;
  h.task_id = 7;
  std::vector<std::byte> events(ranks * proto::kEngineEventBytes);
  for (std::size_t i = 0; i < events.size(); ++i) events[i] = static_cast<std::byte>(i / proto::kEngineEventBytes + 1);
  const std::vector<std::int32_t> src{1, 2, 3}, dst{4, 5, 6};  // 12 id bytes: padding before the events
  return ipc::encode_task_record(h, src, dst, events);
}

TEST(TaskDecoder, ASwapTakesItsOwnRanksEngineEvent) {
  CacheShape shape = kShape;
  shape.rank = 1;
  shape.num_ranks = 3;
  auto d = decode_record(with_events(TaskKind::kSwapToDevice, 3), shape, 0);
  ASSERT_EQ(d.action, Action::kRun) << d.message;
  ASSERT_TRUE(d.work.engine_event.has_value());
  EXPECT_EQ((*d.work.engine_event)[0], 2);
  EXPECT_EQ((*d.work.engine_event)[63], 2);
  EXPECT_FALSE(decode_record(record(TaskKind::kSwapToDevice, {1}, {2}), shape, 0).work.engine_event.has_value());
}

TEST(TaskDecoder, EngineEventsOfAnotherCountOrKindOrSizeAreMalformed) {
  CacheShape shape = kShape;
  shape.num_ranks = 2;
  auto wrong_count = decode_record(with_events(TaskKind::kSwapToHost, 3), shape, 0);
  EXPECT_EQ(wrong_count.status, TaskStatus::kMalformed);
  EXPECT_NE(wrong_count.message.find("3 engine events for 2 ranks"), std::string::npos) << wrong_count.message;
  auto rec = with_events(TaskKind::kSwapToHost, 2);
  proto::TaskRecordHeader h{};
  std::memcpy(&h, rec.data(), sizeof h);
  h.kind = static_cast<std::uint16_t>(TaskKind::kStorageQuery);  // the flag on a storage task
  std::memcpy(rec.data(), &h, sizeof h);
  EXPECT_EQ(decode_record(rec, shape, 0).status, TaskStatus::kMalformed);
  auto cut = with_events(TaskKind::kSwapToHost, 2);
  std::memcpy(&h, cut.data(), sizeof h);
  h.record_bytes -= 16;  // not whole events
  std::memcpy(cut.data(), &h, sizeof h);
  cut.resize(h.record_bytes);
  EXPECT_EQ(decode_record(cut, shape, 0).status, TaskStatus::kMalformed);
}

// A swap and its backup tied by outcome (kTaskFlagBackupPair: the backup keeps
// its swap's id apart from the header; the flag anywhere else is refused, never ignored.
TEST(TaskDecoder, ABackupPairIsASwapToHostAndAPolicyBackupNamingIt) {
  using namespace proto;
  auto swap = decode_record(record(TaskKind::kSwapToHost, {1}, {2}, kTaskFlagBackupPair), kShape, 0);
  ASSERT_EQ(swap.action, Action::kRun) << swap.message;
  auto backup_record = [](std::uint16_t flags, std::uint64_t after) {
    auto sec = section({"k0"});
    proto::TaskRecordHeader h{};
    h.kind = static_cast<std::uint16_t>(TaskKind::kStorageWrite);
    h.format_version = kTaskFormatVersion;
    h.flags = flags;
    h.num_keys = 1;
    h.task_id = 43;
    h.after_task_id = after;
    return ipc::encode_task_record(h, sec, std::vector<std::int32_t>{2});
  };
  const std::uint16_t pair = kTaskFlagBackupPair | kTaskFlagPolicyBackup | kTaskFlagHostBlocks;
  auto backup = decode_record(backup_record(pair, 42), kShape, 0);
  ASSERT_EQ(backup.action, Action::kRun) << backup.message;
  EXPECT_EQ(backup.work.backup_of_swap, 42u);
  for (auto [flags, after] : {std::pair<std::uint16_t, std::uint64_t>{pair, 0},
                              {static_cast<std::uint16_t>(kTaskFlagBackupPair | kTaskFlagHostBlocks), 42},
                              {static_cast<std::uint16_t>(kTaskFlagBackupPair | kTaskFlagPolicyBackup), 42}}) {
    auto d = decode_record(backup_record(flags, after), kShape, 0);
    EXPECT_EQ(d.action, Action::kFail) << flags << " after " << after;
    EXPECT_EQ(d.status, TaskStatus::kMalformed) << d.message;  // on every rank alike: no agreement to abort
  }
  auto in = decode_record(record(TaskKind::kSwapToDevice, {1}, {2}, kTaskFlagBackupPair), kShape, 0);
  EXPECT_EQ(in.action, Action::kFail);
  EXPECT_EQ(in.status, TaskStatus::kMalformed);
}

TEST(TaskDecoder, CacheControlKindsAreTheDispatchersOwn) {
  EXPECT_EQ(decode_record(record(TaskKind::kClearCache, {}, {}), kShape, 0).action, Action::kClear);
  EXPECT_EQ(decode_record(record(TaskKind::kRestoreCache, {}, {}), kShape, 0).action, Action::kRestore);
}

TEST(TaskDecoder, AStorageTaskWithMoreKeysThanBlocksFailsAndAbortsItsAgreement) {
  auto d = decode_record(record(TaskKind::kStorageRead, section({"a", "b"}), {1}, 0, 2), kShape, 0);
  ASSERT_EQ(d.action, Action::kFail);
  EXPECT_EQ(d.status, TaskStatus::kLengthMismatch);
  EXPECT_TRUE(d.abort_agreement) << "the peers wait for this task's agreement";
}

TEST(TaskDecoder, ALoadNamingABlockTwiceIsRefused) {
  auto d = decode_record(record(TaskKind::kStorageRead, section({"a", "b"}), {3, 3}, 0, 2), kShape, 0);
  ASSERT_EQ(d.action, Action::kFail);
  EXPECT_EQ(d.status, TaskStatus::kDuplicateDestination);
}

TEST(TaskDecoder, AStorageReadOfHostBlocksIsCheckedAgainstTheHostPool) {
  auto ok = decode_record(record(TaskKind::kStorageRead, section({"a"}), {7}, proto::kTaskFlagHostBlocks, 1), kShape, 0);
  ASSERT_EQ(ok.action, Action::kRun) << ok.message;
  EXPECT_TRUE(ok.work.storage);
  EXPECT_EQ(ok.work.host_ids, (std::vector<std::int32_t>{7}));
  EXPECT_EQ(ok.work.storage_work.section.keys, (std::vector<std::string>{"a"}));
  auto out = decode_record(record(TaskKind::kStorageRead, section({"a"}), {8}, proto::kTaskFlagHostBlocks, 1), kShape, 0);
  EXPECT_EQ(out.status, TaskStatus::kIdOutOfRange);
}

TEST(TaskDecoder, CancelCarriesItsTargetAndNothingElse) {
  auto d = decode_record(record(TaskKind::kCancel, section({}, 77), {}), kShape, 0);
  ASSERT_EQ(d.action, Action::kCancel) << d.message;
  EXPECT_EQ(d.cancel_task_id, 77u);
  auto bad = decode_record(record(TaskKind::kCancel, section({}, 77), {1}), kShape, 0);
  EXPECT_EQ(bad.status, TaskStatus::kMalformed);
  EXPECT_FALSE(bad.abort_agreement) << "a CANCEL has no agreement";
}

TEST(TaskDecoder, ATruncatedRecordIsMalformed) {
  auto rec = record(TaskKind::kSwapToHost, {1}, {2});
  rec.resize(rec.size() - 16);
  auto d = decode_record(rec, kShape, 0);
  ASSERT_EQ(d.action, Action::kFail);
  EXPECT_EQ(d.status, TaskStatus::kMalformed);
}

}  // namespace
}  // namespace kvtd::daemon

namespace kvtd::daemon {
namespace {

TEST(TaskDecoder, ASwapOverTwoGroupsIsOnePartPerGroupInItsOwnIds) {
  // Device 3 -> host 5 (group 0), device 17 -> host 9 and device 16 -> host 13 (group 1).
  auto d = decode_record(record(TaskKind::kSwapToHost, {3, 17, 16}, {5, 9, 13}), two_groups(), 0);
  ASSERT_EQ(d.action, Action::kRun) << d.message;
  ASSERT_EQ(d.work.parts.size(), 2u);
  EXPECT_EQ(d.work.parts[0].group, 0u);
  EXPECT_EQ(d.work.parts[0].device_ids, (std::vector<std::int32_t>{3}));
  EXPECT_EQ(d.work.parts[0].host_ids, (std::vector<std::int32_t>{5}));
  EXPECT_EQ(d.work.parts[1].group, 1u);
  EXPECT_EQ(d.work.parts[1].device_ids, (std::vector<std::int32_t>{1, 0}));
  EXPECT_EQ(d.work.parts[1].host_ids, (std::vector<std::int32_t>{1, 5}));
  EXPECT_EQ(d.work.parts[1].plan.num_blocks, 2);
  // The block tracker sees the task's own ids.
  EXPECT_EQ(d.work.device_ids, (std::vector<std::int32_t>{3, 17, 16}));
  EXPECT_EQ(d.work.host_ids, (std::vector<std::int32_t>{5, 9, 13}));
}

TEST(TaskDecoder, APairThatLeavesItsGroupFailsNamingBothGroups) {
  auto d = decode_record(record(TaskKind::kSwapToDevice, {9}, {2}), two_groups(), 0);  // host g1 -> device g0
  ASSERT_EQ(d.action, Action::kFail);
  EXPECT_EQ(d.status, TaskStatus::kIdOutOfRange);
  EXPECT_NE(d.message.find("source block 9 is in cache group 1"), std::string::npos) << d.message;
  EXPECT_NE(d.message.find("destination block 2 is in cache group 0"), std::string::npos) << d.message;
  auto out = decode_record(record(TaskKind::kSwapToHost, {20}, {0}), two_groups(), 0);
  EXPECT_EQ(out.status, TaskStatus::kIdOutOfRange);
  EXPECT_NE(out.message.find("outside every cache group"), std::string::npos) << out.message;
}

TEST(TaskDecoder, TwoPairsWritingOneBlockOfAGroupAreRefused) {
  auto d = decode_record(record(TaskKind::kSwapToHost, {16, 17}, {10, 10}), two_groups(), 0);
  ASSERT_EQ(d.action, Action::kFail);
  EXPECT_EQ(d.status, TaskStatus::kDuplicateDestination);
  EXPECT_NE(d.message.find("cache group 1"), std::string::npos) << d.message;
}

TEST(TaskDecoder, AGroupSessionsLayerwiseSwapIsCutByGroup) {
  auto layerwise = decode_record(record(TaskKind::kSwapToDevice, {1, 9}, {2, 17}, proto::kTaskFlagLayerwise),
                                 two_groups(), 0);
  EXPECT_EQ(layerwise.action, Action::kRun) << layerwise.message;  // layer by layer: served
  EXPECT_EQ(layerwise.work.parts.size(), 2u);
}

// A group session's storage task names a block per key and group, group-major, -1 for none
// (daemon/storage/group_agreement.cpp).
TEST(TaskDecoder, AGroupSessionsStorageTaskNamesABlockPerKeyAndGroup) {
  auto query = decode_record(record(TaskKind::kStorageQuery, section({"k1"}), {}, 0, 1), two_groups(), 0);
  EXPECT_EQ(query.action, Action::kRun) << query.message;
  auto read = decode_record(record(TaskKind::kStorageRead, section({"k1", "k2"}), {3, 4, -1, 17}, 0, 2),
                            two_groups(), 0);
  ASSERT_EQ(read.action, Action::kRun) << read.message;
  EXPECT_EQ(read.work.storage_work.blocks, (std::vector<std::int32_t>{3, 4, -1, 17}));
  EXPECT_EQ(read.work.device_ids, (std::vector<std::int32_t>{3, 4, 17}));  // what the hazards track
}

TEST(TaskDecoder, AGroupSessionsStorageTaskWithABlockOutsideItsGroupIsRefusedNamingIt) {
  auto count = decode_record(record(TaskKind::kStorageWrite, section({"k1", "k2"}), {3, 4}, 0, 2), two_groups(), 0);
  EXPECT_EQ(count.status, TaskStatus::kLengthMismatch);
  EXPECT_TRUE(count.abort_agreement);  // the peers stop waiting for it
  EXPECT_NE(count.message.find("a block per key and group"), std::string::npos) << count.message;
  auto outside = decode_record(record(TaskKind::kStorageWrite, section({"k1"}), {16, 17}, 0, 1), two_groups(), 0);
  EXPECT_EQ(outside.status, TaskStatus::kIdOutOfRange);
  EXPECT_NE(outside.message.find("(cache group 0, key 0) is outside [0, 16)"), std::string::npos) << outside.message;
  auto host = decode_record(record(TaskKind::kStorageRead, section({"k1"}), {0, 7}, proto::kTaskFlagHostBlocks, 1),
                            two_groups(), 0);
  EXPECT_EQ(host.status, TaskStatus::kIdOutOfRange);
  EXPECT_NE(host.message.find("host block id 7 at position 1 (cache group 1, key 0) is outside [8, 14)"),
            std::string::npos)
      << host.message;
  // -1 is "none" in a group session only; a single-shape task's -1 is out of range.
  auto single = decode_record(record(TaskKind::kStorageWrite, section({"k1"}), {-1}, 0, 1), kShape, 0);
  EXPECT_EQ(single.status, TaskStatus::kIdOutOfRange);
}

}  // namespace
}  // namespace kvtd::daemon
