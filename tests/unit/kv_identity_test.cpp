// What an engine declares its KV to be beyond its shape (kvtd/proto/kv_identity.h): the layout
// across ranks, the dtype, the pipeline stage and context-parallel slice. Trust round 4 found each
// missing: a vLLM cross-layer slab (no value tensor) was taken for an MLA latent, so every rank
// read rank 0's objects; two pipeline stages and a float16 / bfloat16 pair of one model shared a
// namespace. These tests fail on the code before the identity (no --kv-layout, no fingerprint
// share, no refusal at attach).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/engine/engine_session.h"
#include "kvtd/proto/group_spec.h"
#include "kvtd/proto/kv_identity.h"
#include "kvtd/proto/session.h"
#include "test_support.h"

namespace kvtd {
namespace {

using proto::KvIdentity;
using proto::KvLayout;

KvIdentity identity(KvLayout layout, const char* dtype = "", std::uint16_t pp_rank = 0, std::uint16_t pp_size = 1) {
  KvIdentity id{};
  id.layout = static_cast<std::uint32_t>(layout);
  proto::set_kv_dtype(&id, dtype);
  id.pp_rank = pp_rank;
  id.pp_size = pp_size;
  id.cp_size = 1;
  return id;
}

Result<config::DaemonConfig, config::ConfigErrc> parse(std::vector<std::string> args) {
  args.insert(args.begin(), "kvtd");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return config::parse_daemon_flags(static_cast<int>(argv.size()), argv.data());
}

// One cross-layer slab per rank, as vLLM registers it by default (no value tensor), TP 2, rank 1.
const std::vector<std::string> kSlab{"--rank", "1", "--mp-num", "2", "--num-layers", "1", "--num-host-blocks", "8",
                                     "--key-cache-shape", "16,1,1,4096", "--cache-dtype", "uint8", "--session", "s"};

std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

TEST(KvIdentity, ACrossLayerSlabDeclaredPerRankIsStoredByEveryRankUnderTheTpSize) {
  auto inferred = parse(kSlab);
  ASSERT_TRUE(inferred.ok()) << inferred.error().message;
  EXPECT_EQ(inferred->kv_layout(), KvLayout::kReplicated) << "FastDeploy's launch line: no value cache is MLA";
  auto declared = parse(with(kSlab, {"--kv-layout", "per_rank"}));
  ASSERT_TRUE(declared.ok()) << declared.error().message;
  proto::ObjectSlicing s;
  ASSERT_EQ(declared->object_slicing(&s), "");
  EXPECT_FALSE(s.replicated);
  EXPECT_TRUE(s.writer) << "rank 1 stores its own slab";
  EXPECT_EQ(s.slice_of(0, 1), 1u) << "and reads its own objects, not rank 0's";
  proto::ObjectSlicing r;
  ASSERT_EQ(inferred->object_slicing(&r), "");
  EXPECT_NE(daemon::layout_fingerprint(declared->geometry(), s, declared->kv_identity),
            daemon::layout_fingerprint(inferred->geometry(), r, inferred->kv_identity));
}

TEST(KvIdentity, FlagsRefuseWhatCannotBeAnIdentityNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--kv-layout", "mla"}, "--kv-layout: 'mla' is not one of per_rank, replicated"},
      {{"--kv-dtype", "Float16"}, "--kv-dtype: 'Float16' must be 1-15 of [a-z0-9_]"},
      {{"--kv-dtype", "float8_e4m3fnuz_x"}, "--kv-dtype"},
      {{"--pp-rank", "2", "--pp-size", "2"}, "--pp-rank: 2 is not a rank of --pp-size 2"},
      {{"--cp-size", "0"}, "--cp-size: 0 must be in [1, 1024]"},
  };
  for (const auto& [more, want] : cases) {
    auto c = parse(with(kSlab, more));
    ASSERT_FALSE(c.ok()) << more[0];
    EXPECT_NE(c.error().message.find(want), std::string::npos) << c.error().message;
  }
  auto groups = parse({"--rank", "0", "--session", "g", "--kv-layout", "per_rank", "--cache-group",
                       "kind=full_attention,layers=0-1,tensors=2x4x16@2,device_blocks=8,host_blocks=4,block_tokens=16"});
  ASSERT_FALSE(groups.ok());
  EXPECT_NE(groups.error().message.find("--kv-layout: not with --cache-group"), std::string::npos)
      << groups.error().message;
}

TEST(KvIdentity, TheDtypeAndTheStageEachMakeANamespaceAndNothingDeclaredKeepsTheOldOne) {
  const proto::CacheGeometry g = test::small_geometry(2);
  proto::ObjectSlicing by_rank, replicated;
  replicated.replicated = true;
  const KvIdentity none{};
  const std::uint64_t plain = daemon::layout_fingerprint(g, by_rank, none);
  const std::vector<KvIdentity> declared = {
      identity(KvLayout::kPerRank, "bfloat16"), identity(KvLayout::kPerRank, "float16"),
      identity(KvLayout::kPerRank, "", 0, 2), identity(KvLayout::kPerRank, "", 1, 2)};
  std::vector<std::uint64_t> seen{plain};
  for (const auto& id : declared) seen.push_back(daemon::layout_fingerprint(g, by_rank, id));
  for (std::size_t i = 0; i < seen.size(); ++i)
    for (std::size_t j = i + 1; j < seen.size(); ++j) EXPECT_NE(seen[i], seen[j]) << i << " vs " << j;
  // A replicated latent drops the TP size but never the stage: stage 1 does not read stage 0's.
  EXPECT_NE(daemon::layout_fingerprint(g, replicated, identity(KvLayout::kReplicated, "", 0, 2)),
            daemon::layout_fingerprint(g, replicated, identity(KvLayout::kReplicated, "", 1, 2)));
  // The layout alone is not a namespace of its own (the slicing is): a declared per-rank layout
  // with nothing else finds what an undeclared one stored.
  EXPECT_EQ(daemon::layout_fingerprint(g, by_rank, identity(KvLayout::kPerRank)), plain);
  // Groups: one model's float16 and bfloat16 caches (the same element size) apart.
  proto::CacheGroups gs{};
  ASSERT_EQ(proto::groups_from_specs({"kind=full_attention,layers=0-1,tensors=2x4x16@2,device_blocks=8,host_blocks=4,"
                                      "block_tokens=16"},
                                     2, &gs),
            "");
  EXPECT_NE(daemon::group_fingerprint(gs, 0, identity(KvLayout::kUndeclared, "float16")),
            daemon::group_fingerprint(gs, 0, identity(KvLayout::kUndeclared, "bfloat16")));
}

TEST(KvIdentity, MismatchesNameTheFlagAndAnUndeclaredLayoutTakesTheDaemons) {
  struct Case {
    KvIdentity session;
    KvLayout daemon_layout;
    KvIdentity flags;
    std::string want;  // "" agrees
  };
  const std::vector<Case> cases = {
      {identity(KvLayout::kPerRank), KvLayout::kReplicated, identity(KvLayout::kUndeclared),
       "the engine declares per_rank, this daemon acts on replicated (--kv-layout per_rank)"},
      {identity(KvLayout::kPerRank), KvLayout::kPerRank, identity(KvLayout::kPerRank), ""},
      {identity(KvLayout::kUndeclared), KvLayout::kReplicated, identity(KvLayout::kUndeclared), ""},
      {identity(KvLayout::kPerRank, "bfloat16"), KvLayout::kPerRank, identity(KvLayout::kPerRank),
       "the engine declares 'bfloat16', flags say '' (--kv-dtype)"},
      {identity(KvLayout::kPerRank), KvLayout::kPerRank, identity(KvLayout::kPerRank, "float16"), "(--kv-dtype)"},
      {identity(KvLayout::kPerRank, "", 1, 2), KvLayout::kPerRank, identity(KvLayout::kPerRank),
       "the pipeline stage: the engine's session is rank 1 of 2, flags say 0 of 1 (--pp-rank/--pp-size)"},
      {identity(KvLayout::kPerRank, "", 0, 0), KvLayout::kPerRank, identity(KvLayout::kPerRank, "", 0, 1), ""},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const std::string got = proto::kv_identity_mismatch(cases[i].session, cases[i].daemon_layout, cases[i].flags);
    if (cases[i].want.empty()) EXPECT_EQ(got, "") << i;
    else EXPECT_NE(got.find(cases[i].want), std::string::npos) << i << ": " << got;
  }
  KvIdentity bad = identity(KvLayout::kPerRank);
  bad.layout = 7;
  EXPECT_NE(proto::kv_identity_problem(bad).find("kv layout 7"), std::string::npos);
  bad = identity(KvLayout::kPerRank, "bf16");
  bad.dtype[6] = 'x';  // bytes after the NUL
  EXPECT_NE(proto::kv_identity_problem(bad).find("NUL-padded"), std::string::npos);
  bad = identity(KvLayout::kPerRank, "", 3, 2);
  EXPECT_NE(proto::kv_identity_problem(bad).find("pipeline rank 3 is not a rank of 2"), std::string::npos);
}

// The engine declares a per-rank slab; a daemon started without --kv-layout (which would read
// the value-less cache as an MLA latent and read rank 0's objects) is refused at attach, naming
// the flag; one with the flag attaches.
TEST(KvIdentity, ADaemonThatWouldInferMlaIsRefusedAtAttachNamingTheFlag) {
  test::Watchdog dog(60);
  proto::CacheGeometry g = test::small_geometry(2);
  for (auto& d : g.value_shape) d = 0;
  engine::SessionOptions o;
  o.suffix = test::unique_suffix("kvid_attach");
  o.geometry = g;
  o.only_rank = 1;
  o.kv_identity = identity(KvLayout::kPerRank, "bfloat16");
  o.service_period_ns = 2'000'000;
  o.fencer = [](std::uint64_t, std::int64_t) { return ipc::FenceResult{ipc::FenceOutcome::kFenced, "in-process rank"}; };
  auto s = engine::EngineSession::create(o);
  ASSERT_TRUE(s.ok()) << s.error().message;
  ASSERT_TRUE((*s)->create_host_device_tensors().ok());
  ASSERT_TRUE((*s)->publish().ok());
  endpoint::EndpointOptions eo;
  eo.suffix = o.suffix;
  eo.rank = 1;
  eo.expected = g;
  eo.attach_timeout_ns = 10'000'000'000;
  eo.expected_layout = KvLayout::kReplicated;  // what a daemon without --kv-layout acts on
  eo.expected_identity = identity(KvLayout::kUndeclared, "bfloat16");
  auto refused = endpoint::RankEndpoint::attach(eo);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, ipc::IpcErrc::kGeometryMismatch);
  EXPECT_NE(refused.error().message.find("--kv-layout per_rank"), std::string::npos) << refused.error().message;
  eo.expected_layout = KvLayout::kPerRank;
  auto ep = endpoint::RankEndpoint::attach(eo);
  ASSERT_TRUE(ep.ok()) << ep.error().message;
}

TEST(KvIdentity, ASessionOfCacheGroupsDeclaresNoLayoutAndABadIdentityIsRefusedAtCreate) {
  engine::SessionOptions o;
  o.suffix = test::unique_suffix("kvid_groups");
  ASSERT_EQ(proto::groups_from_specs({"kind=full_attention,layers=0-1,tensors=2x4x16@2,device_blocks=8,host_blocks=4,"
                                      "block_tokens=16"},
                                     1, &o.groups),
            "");
  o.kv_identity = identity(KvLayout::kPerRank);
  auto s = engine::EngineSession::create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("declares each group's layout by its kind"), std::string::npos) << s.error().message;
  engine::SessionOptions single;
  single.suffix = o.suffix;
  single.geometry = test::small_geometry(1);
  single.kv_identity = identity(KvLayout::kPerRank, "", 2, 2);
  auto bad = engine::EngineSession::create(single);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("pipeline rank 2 is not a rank of 2"), std::string::npos) << bad.error().message;
}

}  // namespace
}  // namespace kvtd
