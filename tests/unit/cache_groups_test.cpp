// Cache groups: the one validation, the single-shape geometry as groups, and the loadable-prefix
// rule by group against a table (sglang's PoolHitPolicy semantics, hicache_storage.py:83-91 and
// HiCacheFile.batch_exists_v2 at :602-662; the Python test drives sglang's own code).
#include "kvtd/proto/cache_groups.h"
#include "kvtd/proto/group_hits.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvtd::proto {
namespace {

CacheGroup block_group(GroupKind kind, std::uint32_t first, std::uint32_t last, std::uint32_t step) {
  CacheGroup c{};
  c.kind = static_cast<std::uint32_t>(kind);
  c.block_tokens = 16;
  c.device_blocks = 64;
  c.host_blocks = 128;
  c.num_tensors = 2;
  for (auto& t : c.tensors) t = {};
  c.tensors[0] = {2, 3, {4, 16, 64}};
  c.tensors[1] = {2, 3, {4, 16, 64}};
  for (std::uint32_t l = first; l <= last; l += step) c.add_layer(l);
  return c;
}

// gpt-oss-20b (openai/gpt-oss-20b config.json: num_hidden_layers 24, layer_types alternating
// "sliding_attention" (even layers) and "full_attention", sliding_window 128,
// num_key_value_heads 8, head_dim 64, bfloat16) at TP 2: 4 KV heads per rank, 16-token blocks.
CacheGroups gpt_oss_20b_tp2() {
  CacheGroups gs{};
  gs.num_ranks = 2;
  gs.page_tokens = 16;
  gs.num_groups = 2;
  gs.groups[0] = block_group(GroupKind::kSlidingWindow, 0, 22, 2);
  gs.groups[0].window_tokens = 128;
  gs.groups[1] = block_group(GroupKind::kFullAttention, 1, 23, 2);
  return gs;
}

TEST(CacheGroupsTest, ARealHybridGeometryIsValidAndSizedPerGroup) {
  const CacheGroups gs = gpt_oss_20b_tp2();
  ASSERT_EQ(geometry_problem(gs), "");
  const GroupSizes s = group_sizes(gs);
  // 12 layers x (K + V) x 4 heads x 16 tokens x 64 dims x 2 bytes
  EXPECT_EQ(s.block_bytes[0], 12ull * 2 * 4 * 16 * 64 * 2);
  EXPECT_EQ(s.block_bytes[1], s.block_bytes[0]);
  EXPECT_EQ(s.host_pool_bytes[0], s.block_bytes[0] * 128);
  EXPECT_EQ(s.host_pool_total, 2 * s.host_pool_bytes[0]);
  EXPECT_EQ(s.device_tensor_bytes, 64ull * 4 * 16 * 64 * 2);
}

TEST(CacheGroupsTest, EveryBadFieldIsNamed) {
  struct Case {
    const char* what;
    void (*mutate)(CacheGroups&);
    const char* expect;
  };
  const Case cases[] = {
      {"no ranks", [](CacheGroups& g) { g.num_ranks = 0; }, "num_ranks 0"},
      {"too many groups", [](CacheGroups& g) { g.num_groups = kMaxGroups + 1; }, "num_groups 9"},
      {"no page tokens", [](CacheGroups& g) { g.page_tokens = 0; }, "page_tokens must be positive"},
      {"unknown kind", [](CacheGroups& g) { g.groups[1].kind = 9; }, "group 1 (invalid): kind 9"},
      {"window on full attention", [](CacheGroups& g) { g.groups[1].window_tokens = 4; }, "window_tokens is for"},
      {"window missing", [](CacheGroups& g) { g.groups[0].window_tokens = 0; }, "needs window_tokens > 0"},
      {"block size differs", [](CacheGroups& g) { g.groups[1].block_tokens = 32; }, "must equal page_tokens 16"},
      {"bad element", [](CacheGroups& g) { g.groups[0].tensors[1].element_bytes = 3; }, "tensor 1: element bytes 3"},
      {"zero dim", [](CacheGroups& g) { g.groups[0].tensors[0].dims[2] = 0; }, "tensor 0: dimension 2 must be positive"},
      {"dim past ndim", [](CacheGroups& g) { g.groups[0].tensors[0].ndim = 2; }, "dimension 2 is past ndim"},
      {"tensor past count", [](CacheGroups& g) { g.groups[0].num_tensors = 1; }, "tensor 1 is past num_tensors"},
      {"no device blocks", [](CacheGroups& g) { g.groups[1].device_blocks = 0; }, "device_blocks 0"},
      {"layer twice", [](CacheGroups& g) { g.groups[1].add_layer(0); }, "layer 0 is in groups 0 and 1"},
      {"layer gap", [](CacheGroups& g) { g.groups[1].layers[0] &= ~(std::uint64_t{1} << 3); }, "layer 3 is in no attention group"},
      {"group past count", [](CacheGroups& g) { g.groups[2].add_layer(30); }, "group 2 is past num_groups"},
      {"state with blocks",
       [](CacheGroups& g) {
         g.groups[0].kind = static_cast<std::uint32_t>(GroupKind::kState);
         g.groups[0].window_tokens = 0;
       },
       "block_tokens must be 0"},
      {"huge host pool",
       [](CacheGroups& g) {
         g.groups[0].tensors[0].dims[0] = std::int64_t{1} << 40;
         g.groups[0].host_blocks = 1u << 30;
       },
       "overflow"},
  };
  for (const Case& c : cases) {
    CacheGroups gs = gpt_oss_20b_tp2();
    c.mutate(gs);
    const std::string why = geometry_problem(gs);
    EXPECT_NE(why.find(c.expect), std::string::npos) << c.what << ": got \"" << why << "\"";
  }
}

TEST(CacheGroupsTest, AnIndexerSitsBesideMlaAndNowhereElse) {
  CacheGroups gs{};
  gs.num_ranks = 4;
  gs.page_tokens = 64;
  gs.num_groups = 2;
  // DeepSeek-V3.2-Exp (deepseek-ai/DeepSeek-V3.2-Exp config.json: num_hidden_layers 61,
  // kv_lora_rank 512 + qk_rope_head_dim 64 = a 576-wide latent, index_head_dim 128).
  gs.groups[0] = block_group(GroupKind::kMlaLatent, 0, 60, 1);
  gs.groups[0].block_tokens = 64;
  gs.groups[0].num_tensors = 1;
  gs.groups[0].tensors[0] = {2, 2, {64, 576, 0}};
  gs.groups[0].tensors[1] = {};
  gs.groups[1] = gs.groups[0];
  gs.groups[1].kind = static_cast<std::uint32_t>(GroupKind::kIndexer);
  gs.groups[1].tensors[0] = {1, 2, {64, 132, 0}};
  EXPECT_EQ(geometry_problem(gs), "");
  EXPECT_TRUE(gs.groups[0].replicated());
  EXPECT_TRUE(group_replicated(gs, 1));  // the indexer beside MLA: the same bytes on every rank
  gs.groups[0].kind = static_cast<std::uint32_t>(GroupKind::kFullAttention);
  EXPECT_FALSE(group_replicated(gs, 0));
  EXPECT_FALSE(group_replicated(gs, 1));  // beside a head-split cache: by rank
  gs.groups[0].kind = static_cast<std::uint32_t>(GroupKind::kSlidingWindow);
  gs.groups[0].window_tokens = 128;
  EXPECT_NE(geometry_problem(gs).find("beside MLA or full attention, not sliding_window"), std::string::npos)
      << geometry_problem(gs);
}

TEST(CacheGroupsTest, ASingleShapeGeometryIsOneGroupAndMlaIsDeclared) {
  CacheGeometry g{};
  g.num_ranks = 2;
  g.num_layers = 5;
  g.num_extra_layers = 1;
  g.extra_device_blocks = 10;
  g.dtype = static_cast<std::uint32_t>(CacheDtype::kBlockWiseFp8);
  g.num_host_blocks = 32;
  g.scale_bytes = 4;
  const std::int64_t shape[4] = {40, 2, 16, 128};
  for (int i = 0; i < 4; ++i) g.key_shape[i] = g.value_shape[i] = shape[i];
  ASSERT_EQ(geometry_problem(g), "");
  const CacheGroups gs = groups_of(g, false);
  ASSERT_EQ(geometry_problem(gs), "");
  ASSERT_EQ(gs.num_groups, 2u);
  EXPECT_EQ(gs.groups[0].group_kind(), GroupKind::kFullAttention);
  EXPECT_EQ(gs.groups[0].num_layers(), 4u);
  EXPECT_TRUE(gs.groups[1].has_layer(4));
  EXPECT_EQ(gs.groups[1].device_blocks, 10);
  EXPECT_EQ(gs.groups[0].num_tensors, 4u);  // key, value, key scale, value scale
  // The groups' per-block bytes are the geometry's, tensor for tensor.
  const GroupSizes s = group_sizes(gs);
  EXPECT_EQ(s.block_bytes[0] + s.block_bytes[1], g.bytes_per_block_all_layers());
  EXPECT_EQ(s.host_pool_total, geometry_sizes(g).host_pool_bytes * 4 / 5) << "extra layers share the main pool";

  CacheGeometry mla = g;
  mla.dtype = static_cast<std::uint32_t>(CacheDtype::kBFloat16);
  for (auto& v : mla.value_shape) v = 0;
  const CacheGroups m = groups_of(mla, true);
  ASSERT_EQ(geometry_problem(m), "");
  EXPECT_EQ(m.groups[0].group_kind(), GroupKind::kMlaLatent);
  EXPECT_EQ(groups_of(mla, false).groups[0].group_kind(), GroupKind::kFullAttention) << "never inferred";
}

// present[g] is group g's stored keys as a string: '1' stored, '0' not.
GroupHits hits(const CacheGroups& gs, const std::vector<std::string>& present) {
  const auto n = static_cast<std::uint32_t>(present[0].size());
  return loadable_prefix(gs, n, [&](std::uint32_t g, std::uint32_t k) { return present[g][k] == '1'; });
}

CacheGroups with_kinds(std::vector<GroupKind> kinds, std::uint32_t window_tokens = 0) {
  CacheGroups gs{};
  gs.num_ranks = 1;
  gs.page_tokens = 16;
  gs.num_groups = static_cast<std::uint32_t>(kinds.size());
  std::uint32_t next_layer = 0;
  for (std::uint32_t g = 0; g < gs.num_groups; ++g) {
    // An indexer sits beside layer 0's attention group; every other group has a layer of its own.
    const std::uint32_t layer = kinds[g] == GroupKind::kIndexer ? 0 : next_layer++;
    gs.groups[g] = block_group(kinds[g], layer, layer, 1);
    if (kinds[g] == GroupKind::kSlidingWindow) gs.groups[g].window_tokens = window_tokens;
    if (kinds[g] == GroupKind::kState) gs.groups[g].block_tokens = 0;
  }
  return gs;
}

TEST(GroupHitsTest, EachKindFollowsItsRule) {
  using K = GroupKind;
  struct Case {
    std::vector<K> kinds;
    std::uint32_t window;
    std::vector<std::string> present;
    std::uint32_t pages;
  };
  const Case cases[] = {
      {{K::kFullAttention}, 0, {"1110111"}, 3},                           // a gap ends the prefix
      {{K::kFullAttention, K::kIndexer}, 0, {"111111", "111011"}, 3},     // every page of each
      {{K::kFullAttention, K::kState}, 0, {"111111", "000001"}, 6},       // the state at the end
      {{K::kFullAttention, K::kState}, 0, {"111111", "010100"}, 4},       // the latest saved state
      {{K::kFullAttention, K::kState}, 0, {"111100", "000001"}, 0},       // no state inside the prefix
      {{K::kFullAttention, K::kSlidingWindow}, 48, {"111111", "000111"}, 6},  // 3 pages of window
      {{K::kFullAttention, K::kSlidingWindow}, 40, {"111111", "000111"}, 6},  // 40 tokens: 3 pages
      {{K::kFullAttention, K::kSlidingWindow}, 48, {"111111", "011101"}, 4},  // gap: back to 4
      {{K::kFullAttention, K::kSlidingWindow}, 48, {"111111", "001101"}, 0},  // no 3 in a row
      {{K::kFullAttention, K::kSlidingWindow}, 16, {"111111", "100000"}, 1},
      {{K::kSlidingWindow}, 32, {"0011"}, 4},                           // window only: no ALL group
      {{K::kState}, 0, {"0000"}, 0},
      // sglang's file backend answers 5 here (min of 5 and 10): its state pool has no page 5.
      {{K::kFullAttention, K::kIndexer, K::kState}, 0, {"1111111111", "1111100000", "0000000001"}, 0},
      {{K::kFullAttention, K::kIndexer, K::kState}, 0, {"1111111111", "1111100000", "0001100001"}, 5},
  };
  for (const Case& c : cases) {
    const CacheGroups gs = with_kinds(c.kinds, c.window);
    ASSERT_EQ(geometry_problem(gs), "");
    EXPECT_EQ(hits(gs, c.present).pages, c.pages) << c.present.back();
  }
}

TEST(GroupHitsTest, EachGroupAlsoReportsItsOwnAnswer) {
  const CacheGroups gs = with_kinds({GroupKind::kFullAttention, GroupKind::kIndexer, GroupKind::kState});
  const GroupHits h = hits(gs, {"1111111111", "1111100000", "0001100001"});
  EXPECT_EQ(h.pages, 5u);
  EXPECT_EQ(h.group_pages[0], 10u);
  EXPECT_EQ(h.group_pages[1], 5u);
  EXPECT_EQ(h.group_pages[2], 5u) << "the longest point within the ALL groups' prefix";
  EXPECT_EQ(hits(gs, {"", "", ""}).pages, 0u);
}

}  // namespace
}  // namespace kvtd::proto
