// Where a session with cache groups puts each group's tensors and blocks (kvtd/proto/group_slots.h)
// and the one line of text a group is given as (kvtd/proto/group_spec.h): slots, the id space,
// the spec's encoder and parser round trip, and every bad spec named.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvtd/proto/group_slots.h"
#include "kvtd/proto/group_spec.h"
#include "kvtd/proto/session.h"

namespace kvtd::proto {
namespace {

// DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2-Exp config.json: num_hidden_layers 61, kv_lora_rank
// 512, qk_rope_head_dim 64, index_head_dim 128), as vLLM keeps it in fp8: a 656-byte latent per
// token (vllm/v1/attention/backends/mla/flashmla_sparse.py) and a 132-byte indexer key per token
// (128 fp8 + a 4-byte scale); 64-token blocks. Layers 0-2 here, the rest alike.
CacheGroups mla_with_indexer() {
  CacheGroups gs{};
  gs.num_ranks = 1;
  gs.page_tokens = 64;
  gs.num_groups = 2;
  for (std::uint32_t g = 0; g < 2; ++g) {
    CacheGroup& c = gs.groups[g];
    c.kind = static_cast<std::uint32_t>(g == 0 ? GroupKind::kMlaLatent : GroupKind::kIndexer);
    c.block_tokens = 64;
    c.num_tensors = 1;
    c.tensors[0] = {1, 2, {64, g == 0 ? 656 : 132, 0}};
    c.device_blocks = g == 0 ? 100 : 50;
    c.host_blocks = g == 0 ? 200 : 70;
    for (std::uint32_t l = 0; l < 3; ++l) c.add_layer(l);
  }
  return gs;
}

TEST(GroupSlotsTest, ALayerHoldsItsAttentionTensorsThenItsIndexers) {
  const CacheGroups gs = mla_with_indexer();
  ASSERT_EQ(geometry_problem(gs), "");
  EXPECT_EQ(group_slot(gs, 1, 0).group, 0);
  EXPECT_EQ(group_slot(gs, 1, 1).group, 1);
  EXPECT_EQ(group_slot(gs, 1, 1).tensor, 0u);
  EXPECT_EQ(group_slot(gs, 1, 2).group, -1);
  const TensorDesc d = describe_group_tensor(gs, 0, 2, 1);
  EXPECT_EQ(d.ndim, 3u);
  EXPECT_EQ(d.shape[0], 50);
  EXPECT_EQ(d.shape[2], 132);
  EXPECT_EQ(d.bytes, 50ull * 64 * 132);
  EXPECT_EQ(describe_group_tensor(gs, 0, 2, 3).bytes, 0u);
}

TEST(GroupSlotsTest, EachGroupsBlocksSitSideBySideInOneIdSpace) {
  const GroupIdSpace s = id_space(mla_with_indexer());
  EXPECT_EQ(s.device_blocks(), 150);
  EXPECT_EQ(s.host_blocks(), 270);
  EXPECT_EQ(s.device_group(99), 0);
  EXPECT_EQ(s.device_group(100), 1);
  EXPECT_EQ(s.device_group(150), -1);
  EXPECT_EQ(s.host_group(200), 1);
  EXPECT_EQ(s.host_group(-1), -1);
}

TEST(GroupSlotsTest, MoreThanFourTensorsOnALayerAndTooManyBlocksAreRefused) {
  CacheGroups gs = mla_with_indexer();
  gs.groups[0].num_tensors = 4;
  for (std::uint32_t t = 1; t < 4; ++t) gs.groups[0].tensors[t] = gs.groups[0].tensors[0];
  EXPECT_NE(geometry_problem(gs).find("layer 0 has 5 tensors across its groups, at most 4"), std::string::npos)
      << geometry_problem(gs);
  gs = mla_with_indexer();
  gs.groups[0].device_blocks = INT32_MAX;
  EXPECT_NE(geometry_problem(gs).find("device blocks together"), std::string::npos) << geometry_problem(gs);
}

TEST(GroupSlotsTest, AHeaderIsASingleShapeOrGroupsWithTheirEnvelope) {
  const CacheGroups gs = mla_with_indexer();
  EXPECT_EQ(session_cache_problem(envelope_of(gs), gs), "");
  CacheGeometry g = envelope_of(gs);
  g.num_host_blocks = 3;
  EXPECT_NE(session_cache_problem(g, gs).find("must carry only num_ranks"), std::string::npos);
  CacheGroups stray{};
  stray.page_tokens = 16;
  EXPECT_NE(session_cache_problem(g, stray).find("num_groups is 0 but"), std::string::npos);
}

TEST(GroupSpecTest, EveryGroupRoundTripsThroughItsText) {
  const CacheGroups gs = mla_with_indexer();
  for (std::uint32_t g = 0; g < gs.num_groups; ++g) {
    const std::string text = format_group_spec(gs.groups[g]);
    CacheGroup back{};
    ASSERT_EQ(parse_group_spec(text, &back), "") << text;
    EXPECT_EQ(std::memcmp(&back, &gs.groups[g], sizeof back), 0) << text;
  }
  CacheGroup c{};
  ASSERT_EQ(parse_group_spec("kind=sliding_window,layers=0-22:2/30,tensors=4x16x64@2+4x16x64@2,device_blocks=64,"
                             "host_blocks=128,block_tokens=16,window=128",
                             &c),
            "");
  EXPECT_EQ(c.num_layers(), 13u);
  EXPECT_TRUE(c.has_layer(22) && c.has_layer(30) && !c.has_layer(21));
  EXPECT_EQ(format_group_spec(c),
            "kind=sliding_window,layers=0-22:2/30,tensors=4x16x64@2+4x16x64@2,device_blocks=64,host_blocks=128,"
            "block_tokens=16,window=128");
}

TEST(GroupSpecTest, EveryBadSpecIsNamed) {
  const std::string ok = "kind=state,layers=0,tensors=8@4,device_blocks=4,host_blocks=8";
  const std::pair<std::string, std::string> cases[] = {
      {"kind=bogus,layers=0,tensors=8@4,device_blocks=4,host_blocks=8", "kind 'bogus'"},
      {"kind=state,layers=5-2,tensors=8@4,device_blocks=4,host_blocks=8", "ends before it starts"},
      {"kind=state,layers=0-3:0,tensors=8@4,device_blocks=4,host_blocks=8", "step"},
      {"kind=state,layers=512,tensors=8@4,device_blocks=4,host_blocks=8", "layers below 512"},
      {"kind=state,layers=0,tensors=8,device_blocks=4,host_blocks=8", "<dims joined by x>@<element bytes>"},
      {"kind=state,layers=0,tensors=1x2x3x4@4,device_blocks=4,host_blocks=8", "more than 3 dims"},
      {"kind=state,layers=0,tensors=8@4+8@4+8@4+8@4+8@4,device_blocks=4,host_blocks=8", "at most 4 per layer"},
      {"kind=state,layers=0,tensors=8@4,device_blocks=-1,host_blocks=8", "device_blocks '-1'"},
      {"kind=state,layers=0,tensors=8@4,host_blocks=8", "missing device_blocks"},
      {"kind=state,layers=0,tensors=8@4,device_blocks=4,host_blocks=8,colour=red", "unknown key 'colour'"},
      {"kind=state,layers,tensors=8@4,device_blocks=4,host_blocks=8", "'layers' is not key=value"},
      // A second tensors= would add past the group's four tensors (found writing the fuzz target).
      {"kind=state,layers=0,tensors=8@4+8@4+8@4,tensors=8@4+8@4,device_blocks=4,host_blocks=8",
       "key 'tensors' is given twice"},
  };
  CacheGroup c{};
  EXPECT_EQ(parse_group_spec(ok, &c), "");
  for (const auto& [spec, want] : cases) {
    const std::string why = parse_group_spec(spec, &c);
    EXPECT_NE(why.find(want), std::string::npos) << spec << " -> " << why;
  }
  CacheGroups gs{};
  EXPECT_NE(groups_from_specs({ok, "kind=full_attention,layers=0,tensors=8@2,device_blocks=4,host_blocks=8"}, 1, &gs)
                .find("no group has block_tokens"),
            std::string::npos);
  EXPECT_NE(groups_from_specs({ok, "kind=full_attention,layers=0,tensors=8@2,device_blocks=4,host_blocks=8,"
                                   "block_tokens=16", "kind=indexer,layers=0,tensors=8@1,device_blocks=4,host_blocks=8"},
                              1, &gs)
                .find("group 2 (indexer): block_tokens 0 must equal page_tokens 16"),
            std::string::npos)
      << groups_from_specs({}, 1, &gs);
}

}  // namespace
}  // namespace kvtd::proto
