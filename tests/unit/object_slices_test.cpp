// How a rank's block is cut into stored objects (kvtd/proto/object_slices.h): by rank, by head
// for any TP size, one copy of a replicated cache, and every flag value that cannot work refused
// by name.
#include "kvtd/proto/object_slices.h"

#include <gtest/gtest.h>

#include <string>

namespace kvtd::proto {
namespace {

// Llama-3.1-8B's cache (meta-llama/Llama-3.1-8B config.json: num_key_value_heads 8, head_dim 128,
// num_hidden_layers 32) at `ranks`-way TP: 8 / ranks heads per rank.
CacheGeometry llama_8b(std::uint32_t ranks, std::int64_t heads_per_rank) {
  CacheGeometry g{};
  g.num_ranks = ranks;
  g.num_layers = 32;
  g.dtype = static_cast<std::uint32_t>(CacheDtype::kBFloat16);
  g.num_host_blocks = 64;
  const std::int64_t shape[4] = {128, heads_per_rank, 16, 128};
  for (int i = 0; i < 4; ++i) g.key_shape[i] = g.value_shape[i] = shape[i];
  return g;
}

ObjectSlicing slicing(const CacheGeometry& g, std::uint32_t rank, bool replicated, std::uint32_t object_heads,
                      std::uint32_t kv_heads = 0) {
  ObjectSlicing s;
  const std::string why = object_slicing(g, rank, replicated, object_heads, kv_heads, &s);
  EXPECT_EQ(why, "");
  return s;
}

TEST(ObjectSlicingTest, ByRankIsOneObjectNamedByTheRank) {
  const ObjectSlicing s = slicing(llama_8b(2, 4), 1, false, 0);
  EXPECT_FALSE(s.by_head);
  EXPECT_EQ(s.parts, 1u);
  EXPECT_TRUE(s.writer);
  EXPECT_EQ(s.slice_of(0, 1), 1u);
}

TEST(ObjectSlicingTest, ByHeadEveryTpSizeNamesTheSameObjects) {
  // Objects of 2 heads: TP 1 holds heads 0-7 as 4 objects, TP 2 rank 1 heads 4-7 as 2, TP 4 rank
  // 3 heads 6-7 as 1: the names of a head never depend on the TP size.
  const ObjectSlicing tp1 = slicing(llama_8b(1, 8), 0, false, 2);
  const ObjectSlicing tp2 = slicing(llama_8b(2, 4), 1, false, 2);
  const ObjectSlicing tp4 = slicing(llama_8b(4, 2), 3, false, 2);
  EXPECT_EQ(tp1.parts, 4u);
  EXPECT_EQ(tp2.parts, 2u);
  EXPECT_EQ(tp4.parts, 1u);
  EXPECT_EQ(tp1.slice_of(3, 0), 6u);
  EXPECT_EQ(tp2.slice_of(1, 1), 6u);
  EXPECT_EQ(tp4.slice_of(0, 3), 6u);
  for (const auto* s : {&tp1, &tp2, &tp4}) {
    EXPECT_TRUE(s->by_head && s->writer);
    EXPECT_EQ(s->total_heads, 8u);
  }
}

TEST(ObjectSlicingTest, AReplicatedCacheIsOneCopyRankZeroWrites) {
  CacheGeometry mla = llama_8b(4, 1);
  for (auto& v : mla.value_shape) v = 0;
  const ObjectSlicing r2 = slicing(mla, 2, true, 2);  // object heads do not apply to one latent
  EXPECT_TRUE(r2.replicated);
  EXPECT_FALSE(r2.by_head);
  EXPECT_FALSE(r2.writer);
  EXPECT_EQ(r2.slice_of(0, 2), 0u) << "every rank reads rank 0's copy";
  EXPECT_TRUE(slicing(mla, 0, true, 0).writer);
}

TEST(ObjectSlicingTest, HeadsOnSeveralRanksAreWrittenByTheFirstOfThem) {
  // 2 KV heads at TP 4 (vLLM, sglang: rank r holds head r / (ranks / heads)).
  const CacheGeometry g = llama_8b(4, 1);
  const ObjectSlicing r1 = slicing(g, 1, false, 1, 2), r2 = slicing(g, 2, false, 1, 2);
  EXPECT_EQ(r1.first_head, 0u);
  EXPECT_FALSE(r1.writer) << "rank 0 holds head 0 too and writes it";
  EXPECT_EQ(r2.first_head, 1u);
  EXPECT_TRUE(r2.writer);
  EXPECT_EQ(r2.total_heads, 2u);
  // By rank, a rank that does not write reads the writer's object: the first rank of its head.
  const ObjectSlicing b1 = slicing(g, 1, false, 0, 2), b3 = slicing(g, 3, false, 0, 2);
  EXPECT_FALSE(b1.writer);
  EXPECT_EQ(b1.slice_of(0, 1), 0u);
  EXPECT_EQ(b3.slice_of(0, 3), 2u);
  EXPECT_EQ(slicing(g, 3, false, 0).slice_of(0, 3), 3u) << "without --storage-kv-heads each rank is its own";
}

TEST(ObjectSlicingTest, WhatCannotWorkIsRefusedNamingTheFlag) {
  struct Case {
    CacheGeometry g;
    std::uint32_t object_heads, kv_heads;
    const char* expect;
  };
  CacheGeometry uneven = llama_8b(2, 4);
  uneven.value_shape[1] = 2;
  const Case cases[] = {
      {llama_8b(2, 4), 3, 0, "--storage-object-heads 3 does not divide this rank's 4 KV heads"},
      {llama_8b(4, 2), 4, 0, "--storage-object-heads 4 does not divide this rank's 2 KV heads"},
      {llama_8b(2, 4), 0, 6, "--storage-kv-heads 6: a cache of 4 heads per rank on 2 ranks holds 8 heads"},
      {llama_8b(4, 1), 1, 3, "--storage-kv-heads 3"},
      {uneven, 2, 0, "the key cache has 4 heads and the value cache 2"},
  };
  for (const Case& c : cases) {
    ObjectSlicing s;
    const std::string why = object_slicing(c.g, 0, false, c.object_heads, c.kv_heads, &s);
    EXPECT_NE(why.find(c.expect), std::string::npos) << why;
  }
}

}  // namespace
}  // namespace kvtd::proto
