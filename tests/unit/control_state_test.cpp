// ControlState: what the control thread and the serving loop share about the cache.
#include <gtest/gtest.h>

#include "kvtd/daemon/control_handler.h"

namespace kvtd::daemon {
namespace {

// `kvtd ctl clear` accepted as soon as the cache was live was dropped: the serving loop reset the
// request right after marking the cache live (daemon_main.cpp, before the runner started), so the
// operator's clear timed out and the cache stayed mapped.
TEST(ControlState, AClearAcceptedOnceLiveIsKeptUntilTheCacheLeavesLive) {
  ControlState s;
  s.set_cache(ControlState::Cache::kLive);
  ASSERT_TRUE(s.request_clear(/*drop_host_tier=*/true));
  s.set_cache(ControlState::Cache::kLive);  // what the serving loop does before it runs the runner
  EXPECT_TRUE(s.clear_requested.load());
  EXPECT_TRUE(s.clear_drops_host_tier.load());
  s.set_cache(ControlState::Cache::kCleared);  // the clear happened: the request is satisfied
  EXPECT_FALSE(s.clear_requested.load());
}

// A request that arrives when the cache is not live is not recorded: a stale one would clear the
// cache again right after the engine restored it.
TEST(ControlState, AClearAskedWhileNotLiveLeavesNothingPending) {
  ControlState s;
  EXPECT_FALSE(s.request_clear(false));
  s.set_cache(ControlState::Cache::kCleared);
  EXPECT_FALSE(s.request_clear(false));
  s.set_cache(ControlState::Cache::kLive);
  EXPECT_FALSE(s.clear_requested.load());
}

}  // namespace
}  // namespace kvtd::daemon
