// The storage section of a task record (proto/task.h): what the client encodes, the daemon
// decodes exactly; every inconsistency in counts, lengths or characters is malformed.
#include "kvtd/ipc/task_codec.h"

#include <gtest/gtest.h>

#include <cstring>

namespace kvtd::ipc {
namespace {

using proto::TaskStatus;

TEST(StorageSection, RoundTripsArgumentsAndKeys) {
  proto::StorageTaskArgs a{};
  a.weight_version = 7;
  a.min_hits = 3;
  a.cancel_task_id = 99;
  const std::vector<std::string> keys{"a", "prefix:0123456789abcdef", "x.y-z_9", std::string(proto::kMaxKeyBytes, 'k')};
  const auto words = encode_storage_section(a, keys);
  auto d = decode_storage_section(words, static_cast<std::uint32_t>(keys.size()));
  ASSERT_TRUE(d.ok()) << d.error().message;
  EXPECT_EQ(d->keys, keys);
  EXPECT_EQ(d->args.weight_version, 7u);
  EXPECT_EQ(d->args.min_hits, 3u);
  EXPECT_EQ(d->args.cancel_task_id, 99u);
  auto none = decode_storage_section(encode_storage_section(a, {}), 0);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->keys.empty());
}

TEST(StorageSection, CountsLengthsAndCharactersAreChecked) {
  const std::vector<std::string> keys{"abc", "de"};
  auto words = encode_storage_section({}, keys);
  // A key count the section does not hold.
  EXPECT_EQ(decode_storage_section(words, 3).error().code, TaskStatus::kMalformed);
  EXPECT_EQ(decode_storage_section(words, 1).error().code, TaskStatus::kMalformed);
  EXPECT_EQ(decode_storage_section(std::span(words).first(4), 0).error().code, TaskStatus::kMalformed);
  // Lengths that do not add up to key_bytes.
  auto bad_len = words;
  std::uint16_t len = 4;
  std::memcpy(reinterpret_cast<char*>(bad_len.data()) + sizeof(proto::StorageTaskArgs), &len, 2);
  EXPECT_EQ(decode_storage_section(bad_len, 2).error().code, TaskStatus::kMalformed);
  // An empty key (lengths 5 + 0 add up) and a character outside the set.
  auto empty = words;
  std::uint16_t lens[2] = {5, 0};
  std::memcpy(reinterpret_cast<char*>(empty.data()) + sizeof(proto::StorageTaskArgs), lens, 4);
  EXPECT_EQ(decode_storage_section(empty, 2).error().code, TaskStatus::kMalformed);
  auto slash = words;
  reinterpret_cast<char*>(slash.data())[sizeof(proto::StorageTaskArgs) + 4 + 1] = '/';
  auto r = decode_storage_section(slash, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("key 0"), std::string::npos) << r.error().message;
  // More keys than a task may carry, whatever the section says.
  EXPECT_EQ(decode_storage_section(words, proto::kMaxKeysPerTask + 1).error().code, TaskStatus::kMalformed);
}

TEST(StorageSection, EngineKeysAreBoundedAndPlain) {
  EXPECT_TRUE(valid_engine_key("0f9a:12.ab-c_d"));
  EXPECT_FALSE(valid_engine_key(""));
  EXPECT_FALSE(valid_engine_key(std::string(proto::kMaxKeyBytes + 1, 'a')));
  EXPECT_FALSE(valid_engine_key("a/b"));
  EXPECT_FALSE(valid_engine_key("a b"));
  EXPECT_FALSE(valid_engine_key(std::string("a\0b", 3)));
}

TEST(TaskRecord, SwapRecordsCarryNoKeysAndFlagsMatchTheirKind) {
  proto::TaskRecordHeader h{};
  h.kind = static_cast<std::uint16_t>(proto::TaskKind::kSwapToHost);
  h.format_version = proto::kTaskFormatVersion;
  h.record_bytes = sizeof h;
  h.num_keys = 1;
  std::vector<std::byte> rec(sizeof h);
  std::memcpy(rec.data(), &h, sizeof h);
  EXPECT_EQ(decode_task_record(rec, nullptr).error().code, TaskStatus::kMalformed);
  h.num_keys = 0;
  h.flags = proto::kTaskFlagHostBlocks;
  std::memcpy(rec.data(), &h, sizeof h);
  EXPECT_EQ(decode_task_record(rec, nullptr).error().code, TaskStatus::kMalformed);
  h.kind = static_cast<std::uint16_t>(proto::TaskKind::kStorageRead);
  h.flags = proto::kTaskFlagEvictBackup;  // backups are writes of host blocks only
  std::memcpy(rec.data(), &h, sizeof h);
  EXPECT_EQ(decode_task_record(rec, nullptr).error().code, TaskStatus::kMalformed);
  h.kind = proto::kMaxTaskKind + 1;
  h.flags = 0;
  std::memcpy(rec.data(), &h, sizeof h);
  EXPECT_EQ(decode_task_record(rec, nullptr).error().code, TaskStatus::kUnknownKind);
}

TEST(TaskRecord, CacheControlRecordsCarryNothingAndOnlyClearDropsTheHostTier) {
  auto decode = [](proto::TaskKind kind, std::uint16_t flags, std::uint32_t ids) {
    proto::TaskRecordHeader h{};
    h.kind = static_cast<std::uint16_t>(kind);
    h.flags = flags;
    h.format_version = proto::kTaskFormatVersion;
    h.num_dst = ids;
    h.record_bytes = static_cast<std::uint32_t>(proto::task_record_bytes(0, ids));
    std::vector<std::byte> rec(h.record_bytes);
    std::memcpy(rec.data(), &h, sizeof h);
    return decode_task_record(rec, nullptr);
  };
  EXPECT_TRUE(decode(proto::TaskKind::kClearCache, proto::kTaskFlagDropHostTier, 0).ok());
  EXPECT_TRUE(decode(proto::TaskKind::kRestoreCache, 0, 0).ok());
  EXPECT_EQ(decode(proto::TaskKind::kRestoreCache, proto::kTaskFlagDropHostTier, 0).error().code, TaskStatus::kMalformed);
  EXPECT_EQ(decode(proto::TaskKind::kSwapToHost, proto::kTaskFlagDropHostTier, 0).error().code, TaskStatus::kMalformed);
  EXPECT_EQ(decode(proto::TaskKind::kClearCache, 0, 2).error().code, TaskStatus::kMalformed);
}

}  // namespace
}  // namespace kvtd::ipc
