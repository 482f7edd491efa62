#include "kvtd/transport/head_plan.h"

#include <string>

namespace kvtd::transport {

namespace {

std::string check(const HeadLayout& l, const char* side) {
  if (l.ranks == 0 || l.kv_heads == 0) return std::string(side) + ": ranks and KV heads must be positive";
  if (l.replicated) return "";
  if (l.kv_heads % l.ranks != 0 && l.ranks % l.kv_heads != 0)
    return std::string(side) + ": " + std::to_string(l.kv_heads) + " KV heads on " + std::to_string(l.ranks) +
           " ranks (neither divides the other: heads cannot be given out evenly)";
  return "";
}

// The first rank of `l` holding global head `g`, and g's place in that rank's block.
std::pair<std::uint32_t, std::uint32_t> owner(const HeadLayout& l, std::uint32_t g) {
  if (l.kv_heads >= l.ranks) {
    const auto per = l.kv_heads / l.ranks;
    return {g / per, g % per};
  }
  return {g * (l.ranks / l.kv_heads), 0};
}

// Rank `r`'s first global head.
std::uint32_t first_head(const HeadLayout& l, std::uint32_t r) {
  return l.kv_heads >= l.ranks ? r * (l.kv_heads / l.ranks) : r * l.kv_heads / l.ranks;
}

}  // namespace

std::uint32_t heads_per_rank(const HeadLayout& l) {
  return l.replicated || l.kv_heads < l.ranks ? 1 : l.kv_heads / l.ranks;
}

Result<std::vector<HeadRun>, TransportErrc> heads_from(const HeadLayout& from, const HeadLayout& to,
                                                        std::uint32_t dest) {
  for (const auto& problem : {check(from, "prefill"), check(to, "decode")})
    if (!problem.empty()) return make_error(TransportErrc::kInvalidArgument, problem);
  if (from.replicated != to.replicated)
    return make_error(TransportErrc::kInvalidArgument, "one side's cache is replicated (MLA) and the other's is not");
  if (from.kv_heads != to.kv_heads && !from.replicated)
    return make_error(TransportErrc::kInvalidArgument, "prefill has " + std::to_string(from.kv_heads) +
                                                           " KV heads, decode " + std::to_string(to.kv_heads));
  if (dest >= to.ranks)
    return make_error(TransportErrc::kInvalidArgument,
                      "decode rank " + std::to_string(dest) + " of " + std::to_string(to.ranks));
  if (from.replicated)
    return std::vector<HeadRun>{{static_cast<std::uint32_t>(std::uint64_t{dest} * from.ranks / to.ranks), 0, 0, 1}};
  std::vector<HeadRun> runs;
  const auto first = first_head(to, dest);
  for (std::uint32_t i = 0; i < heads_per_rank(to); ++i) {
    const auto [rank, local] = owner(from, first + i);
    if (!runs.empty() && runs.back().source_rank == rank && runs.back().source_head + runs.back().heads == local)
      ++runs.back().heads;
    else
      runs.push_back({rank, local, i, 1});
  }
  return runs;
}

}  // namespace kvtd::transport
