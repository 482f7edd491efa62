// The names objects are stored under (kvtd/storage/object_name.h): every encoded name parses
// back to its parts, every name that parses encodes back to the same text, and what kvtd did not
// make (or makes no more) does not parse. tests/fuzz/fuzz_object_name.cpp checks the same on
// arbitrary input.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvtd/storage/object_name.h"

namespace kvtd::storage {
namespace {

TEST(StoredName, EveryEncodedNameParsesBackToItsParts) {
  const std::vector<StoredName> names = {
      {"1001", "", 0, 0, 0},
      {"pfx:07", "", 3, 12, 15},
      {"a.b", "", 1, 2, 0},                  // dots in the engine's key
      {"x.r5.w1", "", 0, 0, 3},              // a key that looks like the suffix
      {"abc", "RL-STEP12", 0, 4, 1},         // FastDeploy's RL prefix
      {"abc", "v1.2", 7, 7, 9999},           // a prefix with dots, the largest rank
      {"k", "", UINT64_MAX, UINT64_MAX, 0},  // the largest weight versions
      {"k", "", 1, 2, 6, true},              // an object of heads 6.. (--storage-object-heads)
      {"x.h5.w1", "RL-1", 0, 0, 0, true},    // a key and a prefix that look like the suffix
  };
  for (const auto& n : names) {
    const std::string text = n.encode();
    const auto back = StoredName::parse(text, n.key_prefix);
    ASSERT_TRUE(back.has_value()) << text;
    EXPECT_EQ(*back, n) << text;
    EXPECT_EQ(back->encode(), text);
  }
}

// What the KV events publisher reports for an evicted or collected object: the engine's key.
TEST(StoredName, TheEnginesKeyComesBackWithOrWithoutAPrefix) {
  auto key_of = [](const std::string& text, const std::string& prefix) -> std::optional<std::string> {
    auto n = StoredName::parse(text, prefix);
    return n ? std::optional<std::string>(n->key) : std::nullopt;
  };
  EXPECT_EQ(key_of("1001.w0-0.r0", ""), "1001");
  EXPECT_EQ(key_of("abc.RL-STEP12.w0-4.r1", "RL-STEP12"), "abc");
  EXPECT_EQ(key_of("abc.RL-STEP12.w0-4.r1", ""), "abc.RL-STEP12");  // no prefix given: it stays on
  EXPECT_EQ(key_of("abc.w0-4.r1", "RL-STEP12"), std::nullopt);      // not of this prefix
  EXPECT_EQ(key_of(".RL-STEP12.w0-4.r1", "RL-STEP12"), std::nullopt);
  EXPECT_EQ(key_of("abc.RL-STEP12.w0-4.h12", "RL-STEP12"), "abc");
}

TEST(StoredName, WhatKvtdDidNotMakeDoesNotParse) {
  for (const char* text : {"abc.w0-4", "abc.wx-4.r1", ".w0-0.r0", "abc.w0-0.r", "abc.w01-0.r0", "abc.w0-00.r0",
                           "abc.w0-0.r01", "abc.w0-0.r12345", "abc.w0-0.h", "abc.w0-0.h01", "abc.w0-0.x1", "abc.w18446744073709551616-0.r0", "abc.w-0.r0",
                           "abc.w0.r0", "a/b.w0-0.r0", "a b.w0-0.r0", "", "abc"})
    EXPECT_FALSE(StoredName::parse(text).has_value()) << text;
  EXPECT_FALSE(StoredName::parse(std::string(195, 'k') + ".w0-0.r0").has_value()) << "over a storage key's 200";
}

TEST(ObjectName, RoundTripsAndRefusesForeignNames) {
  const ObjectName n{"llama-3.1_8b", 0x00abcdef12345678ull, "1001.w0-0.r0"};
  EXPECT_EQ(n.encode(), "llama-3.1_8b/00abcdef12345678/1001.w0-0.r0");
  EXPECT_EQ(ObjectName::parse(n.encode()), n);
  EXPECT_EQ(fingerprint_hex(0xabc), "0000000000000abc");
  for (const char* text : {"m/00ABCDEF12345678/k", "m/0abcdef12345678/k", "m/00abcdef12345678/", "/00abcdef12345678/k",
                           "m/00abcdef12345678/a/b", "m:x/00abcdef12345678/k", "m00abcdef12345678k", "m/00abcdef1234567g/k"})
    EXPECT_FALSE(ObjectName::parse(text).has_value()) << text;
}

}  // namespace
}  // namespace kvtd::storage
