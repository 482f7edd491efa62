// kvtd/kernels/copy_plan.h - validate a task's block ids and merge them into copy runs.
//
// A plan is computed once per task and reused for every layer and tensor, since all of them
// share the block geometry. Pair i copies source block src[i] to destination block dst[i].
// Pairs whose source and destination ids both continue the previous pair become one run
// (one memcpy / cudaMemcpyAsync); pairs that stand alone are "singles" (one kernel launch per
// layer on the GPU, one memcpy each on the host).
//
// Thread-safety: plan_copy is reentrant (it uses thread-local scratch). A CopyPlan is a plain
// value: copyable, movable, immutable after construction by convention.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvtd/proto/expected.h"

namespace kvtd::kernels {

enum class PlanErrc {
  kLengthMismatch,        // source and destination lists differ in length
  kSourceOutOfRange,      // a source id < 0 or >= source block count
  kDestinationOutOfRange, // a destination id < 0 or >= destination block count
  kDuplicateDestination,  // two pairs write the same destination block
  kSizeOverflow,          // block counts times block bytes overflow 64 bits
};

struct CopyRun {
  std::int32_t src;    // first source block
  std::int32_t dst;    // first destination block
  std::int32_t count;  // >= 2 consecutive blocks on both sides
};

struct CopyPlan {
  std::vector<CopyRun> runs;
  std::vector<std::int32_t> single_src;  // scattered pairs, same length as single_dst
  std::vector<std::int32_t> single_dst;
  std::int64_t num_blocks = 0;            // pairs covered (runs + singles)
};

// Validates the pairs against the block counts of both sides and every tensor's per-block byte
// size, and returns the plan. Runs are maximal: no run can be extended by a neighbouring pair.
// An empty task is valid and yields an empty plan.
[[nodiscard]] Result<CopyPlan, PlanErrc> plan_copy(std::span<const std::int32_t> src,
                                                   std::span<const std::int32_t> dst,
                                                   std::int64_t src_blocks, std::int64_t dst_blocks,
                                                   std::span<const std::uint64_t> block_bytes);

// The same pairs with every run cut into singles (runs' pairs first, in order, then the plan's
// singles): for a copy that treats each pair alike, such as the copy kernel summing each pair
// it copies for --verify-swaps.
CopyPlan singles_only(const CopyPlan& plan);

const char* plan_errc_name(PlanErrc e);

}  // namespace kvtd::kernels
