// kvtd/transport/head_plan.h - which heads a decode rank reads from which prefill ranks when the
// two deployments' tensor-parallel sizes differ (prefill TP 2 to decode TP 1 or 4, say).
//
// A rank's block of a head-split cache holds its KV heads outermost ([heads, tokens, head_dim]
// per tensor, as kvtd's TP-portable storage has it, object_slices.h), so a run of heads is one
// contiguous piece of each tensor's block. Rank r of a TP-T deployment of a model with H KV heads
// holds heads [r H/T, (r+1) H/T) when H >= T; with fewer heads than ranks each head is replicated,
// rank r holding head r H / T (vLLM and sglang give heads so; vLLM's NIXL connector reads them so,
// nixl/tp_mapping.py:80-97, keeping only the first rank of each head). A replicated cache (an MLA
// latent: the same bytes on every rank) is read whole from one prefill rank, destination rank d
// from rank d * T_prefill / T_decode (spread over the prefill ranks, as tp_mapping.py:84 does).
//
// Pure functions: thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "kvtd/proto/expected.h"
#include "kvtd/transport/transport_errc.h"

namespace kvtd::transport {

struct HeadLayout {
  std::uint32_t ranks = 1;      // the deployment's TP size
  std::uint32_t kv_heads = 1;   // the model's KV heads (the same on both sides)
  bool replicated = false;      // every rank holds the same bytes (MLA)
};

// A run of heads destination rank d reads: `heads` heads from `source_rank`'s block starting at
// its local head `source_head`, into d's block starting at its local head `dest_head`. For a
// replicated cache one run of every head (0, 0, 1): the whole block.
struct HeadRun {
  std::uint32_t source_rank = 0;
  std::uint32_t source_head = 0;
  std::uint32_t dest_head = 0;
  std::uint32_t heads = 0;
};

// Heads per rank's block: H/T, or 1 where heads are replicated (H < T).
std::uint32_t heads_per_rank(const HeadLayout& l);

// The runs, in the destination's head order, that fill destination rank `dest` of `to` from the
// ranks of `from`: each of its heads exactly once. kInvalidArgument naming the mismatch: layouts
// that disagree on the heads or on replication, heads and ranks neither of which divides the
// other, a destination rank outside `to`.
Result<std::vector<HeadRun>, TransportErrc> heads_from(const HeadLayout& from, const HeadLayout& to,
                                                        std::uint32_t dest);

}  // namespace kvtd::transport
