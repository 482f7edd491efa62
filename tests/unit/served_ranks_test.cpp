// Sessions that serve one rank of a TP group (SessionOptions::only_rank: an engine with one
// process per rank). The header's served_ranks is hostile input like every other field; the
// engine registers, grants and expects the served rank alone; a daemon of another rank is refused.
#include <gtest/gtest.h>

#include <cstring>

#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/engine/engine_session.h"
#include "kvtd/ipc/segment.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/kvtd_client.h"
#include "test_support.h"

namespace kvtd {
namespace {

using engine::EngineSession;
using engine::SessionOptions;

std::unique_ptr<EngineSession> serving(const std::string& suffix, std::optional<std::uint32_t> rank) {
  SessionOptions o;
  o.suffix = suffix;
  o.geometry = test::small_geometry(2);
  o.only_rank = rank;
  o.service_period_ns = 2'000'000;
  // The rank of these tests is an endpoint inside this very process: never kill it.
  o.fencer = [](std::uint64_t, std::int64_t) { return ipc::FenceResult{ipc::FenceOutcome::kFenced, "in-process rank"}; };
  auto s = EngineSession::create(o);
  EXPECT_TRUE(s.ok()) << (s.ok() ? "" : s.error().message);
  return s.ok() ? std::move(s).value() : nullptr;
}

TEST(ServedRanks, AHeaderNamingARankBeyondTheGeometryIsCorrupt) {
  const auto suffix = test::unique_suffix("served_corrupt");
  auto s = serving(suffix, 1);
  ASSERT_TRUE(s);
  auto seg = ipc::SharedObject::open(ipc::detail::session_name(suffix));
  ASSERT_TRUE(seg.ok());
  auto copy = ipc::detail::copy_header(*reinterpret_cast<const proto::SessionHeader*>((*seg)->data()));
  EXPECT_EQ(copy.served_ranks, 2u);
  EXPECT_TRUE(ipc::detail::validate_header(copy, (*seg)->size()).ok());
  copy.served_ranks = 1u << 2;  // rank 2 of a 2-rank geometry
  const auto v = ipc::detail::validate_header(copy, (*seg)->size());
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.error().code, ipc::IpcErrc::kCorrupt);
  EXPECT_NE(v.error().message.find("served_ranks"), std::string::npos) << v.error().message;
}

TEST(ServedRanks, OnlyRankOutsideTheGeometryIsRefusedAtCreate) {
  SessionOptions o;
  o.suffix = test::unique_suffix("served_outside");
  o.geometry = test::small_geometry(2);
  o.only_rank = 2;
  auto s = EngineSession::create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("only_rank 2 is not a rank of the 2-rank geometry"), std::string::npos)
      << s.error().message;
}

TEST(ServedRanks, TheServedRankAttachesAndAnotherIsRefusedNamingIt) {
  test::Watchdog dog(60);
  const auto suffix = test::unique_suffix("served_attach");
  auto s = serving(suffix, 1);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s->create_host_device_tensors().ok());
  ASSERT_TRUE(s->publish().ok()) << "rank 1's tensors alone complete the registry";
  endpoint::EndpointOptions eo;
  eo.suffix = suffix;
  eo.expected = test::small_geometry(2);
  eo.attach_timeout_ns = 10'000'000'000;
  eo.rank = 0;
  auto refused = endpoint::RankEndpoint::attach(eo);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("serves rank 1 only"), std::string::npos) << refused.error().message;
  eo.rank = 1;
  auto ep = endpoint::RankEndpoint::attach(eo);
  ASSERT_TRUE(ep.ok()) << ep.error().message;
  EXPECT_TRUE(s->rank_alive(1));
  EXPECT_FALSE(s->rank_alive(0)) << "not a rank of this session";
  // Alone in the agreement: its own count, at once.
  auto agreed = (*ep)->agree(0, 7, 0);
  ASSERT_TRUE(agreed.ok()) << agreed.error().message;
  EXPECT_EQ(*agreed, 7u);
}

TEST(ServedRanks, TheCApiRefusesUnknownOptionFlagsAndARankOutsideTheGeometry) {
  const proto::CacheGeometry g = test::small_geometry(2);
  kvtd_geometry cg{};
  static_assert(sizeof cg == sizeof g);
  std::memcpy(&cg, &g, sizeof cg);
  const std::string suffix = test::unique_suffix("served_c");
  char err[256] = {};
  kvtd_session* s = nullptr;
  kvtd_session_options opts{};
  opts.flags = 1u << 7;
  EXPECT_EQ(kvtd_session_create_with(suffix.c_str(), &cg, &opts, &s, err, sizeof err), KVTD_E_INVALID);
  EXPECT_NE(std::string(err).find("unknown session option flags 128"), std::string::npos) << err;
  opts = kvtd_session_options{};
  opts.flags = KVTD_SESSION_ONLY_RANK;
  opts.only_rank = 2;
  EXPECT_NE(kvtd_session_create_with(suffix.c_str(), &cg, &opts, &s, err, sizeof err), KVTD_OK);
  EXPECT_NE(std::string(err).find("only_rank 2"), std::string::npos) << err;
  opts.only_rank = 1;
  ASSERT_EQ(kvtd_session_create_with(suffix.c_str(), &cg, &opts, &s, err, sizeof err), KVTD_OK) << err;
  kvtd_session_destroy(s);
}

}  // namespace
}  // namespace kvtd
