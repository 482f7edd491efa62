// endpoint_helpers.h - an in-process rank for unit tests of the engine side: attach options and
// a completion report, so a test plays the daemon without starting one.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "kvtd/endpoint/rank_endpoint.h"

namespace kvtd::test {

inline endpoint::EndpointOptions endpoint_options(const std::string& suffix, std::uint32_t rank, proto::CacheGeometry g) {
  endpoint::EndpointOptions o;
  o.suffix = suffix;
  o.rank = rank;
  o.expected = g;
  o.attach_timeout_ns = 2'000'000'000;
  return o;
}

// A completion with this rank, status and block count.
inline void report(endpoint::RankEndpoint& ep, std::uint64_t id, std::uint32_t rank, proto::TaskStatus st,
                   std::uint64_t blocks) {
  proto::CompletionRecord rec{};
  rec.task_id = id;
  rec.rank = rank;
  rec.status = static_cast<std::int32_t>(st);
  rec.blocks_done = blocks;
  std::snprintf(rec.message, sizeof rec.message, "rank %u says %s", rank, proto::task_status_name(st));
  ASSERT_TRUE(ep.complete(rec).ok());
}

}  // namespace kvtd::test
