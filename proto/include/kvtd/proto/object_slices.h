// kvtd/proto/object_slices.h - how a rank's block is cut into stored objects, so that stored KV
// is shared across tensor-parallel sizes where its bytes allow.
//
// A rank's block of a head-split cache holds kv_heads_per_rank heads in every tensor
// ([heads, tokens, head_dim] or [heads, tokens] for fp8 scales, heads outermost), so the bytes of
// a run of heads are one contiguous piece of each tensor's block. Stored by rank (the default),
// an object is the rank's whole slice, named ".r<rank>", and only a deployment of the same TP
// size can read it. Stored by head (--storage-object-heads N), an object holds N heads of every
// layer and tensor, named ".h<first global head>": a rank of any TP size whose head count is a
// multiple of N reads and writes its heads as heads-per-rank / N objects, so a TP-4 deployment
// loads what a TP-2 one stored (sgl-project/sglang#18541 asks for this).
//
// A replicated cache (MLA: one latent, the same bytes on every rank) is stored once by rank 0
// under rank 0's name and read by every rank of any TP size. Heads replicated across ranks
// (fewer KV heads than ranks, e.g. 8 heads at TP 16: vLLM and sglang give rank r head
// r / (ranks / heads)) are stored by the first rank of each head only.
//
// Values; the functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "kvtd/proto/geometry.h"

namespace kvtd::proto {

struct ObjectSlicing {
  bool by_head = false;             // names ".h<first head>" (true) or ".r<rank>"
  bool replicated = false;          // one copy serves every rank (MLA)
  bool writer = true;               // this rank stores objects (one copy of each slice is enough)
  std::uint32_t parts = 1;          // objects per key on this rank
  std::uint32_t heads_per_part = 0; // by_head: KV heads in one object
  std::uint32_t first_head = 0;     // by_head: this rank's first global KV head
  std::uint32_t total_heads = 0;    // by_head: the model's KV heads
  std::uint32_t head_replicas = 1;  // ranks holding each head (--storage-kv-heads below the ranks)

  // The slice id in the name of part `part` of rank `rank`'s block: a first head; or the rank
  // that writes this rank's heads (itself, the first rank holding its head, 0 for a replicated
  // cache).
  constexpr std::uint32_t slice_of(std::uint32_t part, std::uint32_t rank) const {
    return by_head ? first_head + part * heads_per_part : replicated ? 0 : rank / head_replicas * head_replicas;
  }
};

// How rank `rank` of geometry `g` stores its blocks. `replicated`: the cache is one copy on
// every rank (MLA). `object_heads`: --storage-object-heads (0 = by rank). `kv_heads`:
// --storage-kv-heads, the model's KV heads (0 = heads per rank x ranks). "" and *out filled, or
// the problem in words naming the flag. `g` passed geometry_problem.
inline std::string object_slicing(const CacheGeometry& g, std::uint32_t rank, bool replicated,
                                  std::uint32_t object_heads, std::uint32_t kv_heads, ObjectSlicing* out) {
  ObjectSlicing s;
  const auto per_rank = static_cast<std::uint64_t>(g.key_shape[1]);
  if (replicated) {  // one copy whatever the heads: every TP size reads rank 0's objects
    s.replicated = true;
    s.writer = rank == 0;
    *out = s;
    return "";
  }
  if (g.has_value() && static_cast<std::uint64_t>(g.value_shape[1]) != per_rank && object_heads != 0)
    return "--storage-object-heads: the key cache has " + std::to_string(per_rank) + " heads and the value cache " +
           std::to_string(g.value_shape[1]) + "; objects by head need the same heads in both";
  const std::uint64_t split = per_rank * g.num_ranks;
  std::uint64_t replicas = 1;
  if (kv_heads != 0 && kv_heads != split) {
    if (per_rank != 1 || g.num_ranks % kv_heads != 0)
      return "--storage-kv-heads " + std::to_string(kv_heads) + ": a cache of " + std::to_string(per_rank) +
             " heads per rank on " + std::to_string(g.num_ranks) + " ranks holds " + std::to_string(split) +
             " heads, or fewer heads each replicated on ranks/heads ranks (1 head per rank, ranks a multiple of heads)";
    replicas = g.num_ranks / kv_heads;
  }
  s.writer = rank % replicas == 0;
  s.head_replicas = static_cast<std::uint32_t>(replicas);
  if (object_heads == 0) {
    *out = s;
    return "";
  }
  if (per_rank % object_heads != 0)
    return "--storage-object-heads " + std::to_string(object_heads) + " does not divide this rank's " +
           std::to_string(per_rank) + " KV heads: a rank reads and writes whole objects; every TP size sharing the "
           "store needs a value dividing its heads per rank (1 always does)";
  if (split / replicas > 9999)  // a stored name's head is at most 4 digits (object_name.h)
    return "--storage-object-heads: a cache of " + std::to_string(split / replicas) +
           " KV heads cannot be stored by head (at most 9999)";
  s.by_head = true;
  s.heads_per_part = object_heads;
  s.parts = static_cast<std::uint32_t>(per_rank / object_heads);
  s.total_heads = static_cast<std::uint32_t>(split / replicas);
  s.first_head = static_cast<std::uint32_t>(rank / replicas * per_rank);
  *out = s;
  return "";
}

}  // namespace kvtd::proto
