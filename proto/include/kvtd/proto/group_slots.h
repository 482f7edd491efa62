// kvtd/proto/group_slots.h - where a session with cache groups puts each group's tensors and
// blocks, so the registry, the task records and the block tracker keep the one shape they have.
//
// Tensors: a session registers kTensorKinds (4) tensors per layer and rank. In a group session,
// slot k of layer l holds the layer's attention-group tensors first (tensor 0, 1, ... of that
// group), then those of its indexer group, if it has one. geometry_problem(CacheGroups) refuses
// a layer with more than 4 tensors across its groups.
//
// Blocks: a task names block ids in one space per side. Group g's device block b is id
// device_base[g] + b and its host block h is id host_base[g] + h: the groups' blocks side by
// side, in group order. A swap pair must stay inside one group on both sides. The same space
// serves a single-shape session: one group, bases 0.
//
// Pure functions over plain values: thread-safe, no allocation.
#pragma once

#include <cstdint>

#include "kvtd/proto/cache_groups.h"

namespace kvtd::proto {

// The group and tensor at registry slot `slot` of layer `layer`; group -1 when the slot is empty.
struct GroupSlot {
  std::int32_t group = -1;
  std::uint32_t tensor = 0;
};

constexpr GroupSlot group_slot(const CacheGroups& gs, std::uint32_t layer, std::uint32_t slot) {
  std::uint32_t next = 0;
  for (const bool indexer : {false, true})
    for (std::uint32_t g = 0; g < gs.num_groups && g < kMaxGroups; ++g) {
      const CacheGroup& c = gs.groups[g];
      if (!c.has_layer(layer) || is_attention_kind(c.group_kind()) == indexer) continue;
      if (slot < next + c.num_tensors) return {static_cast<std::int32_t>(g), slot - next};
      next += c.num_tensors;
    }
  return {};
}

// Bytes of one block of one group tensor (checked against overflow by geometry_problem).
constexpr std::uint64_t group_tensor_block_bytes(const GroupTensor& t) {
  std::uint64_t b = t.element_bytes;
  for (std::uint32_t d = 0; d < t.ndim && d < kMaxGroupTensorDims; ++d) b *= static_cast<std::uint64_t>(t.dims[d]);
  return b;
}

// The block id space of a group list: group g's ids are [base[g], base[g + 1]) on each side.
struct GroupIdSpace {
  std::uint32_t num_groups = 0;
  std::int64_t device_base[kMaxGroups + 1] = {};
  std::int64_t host_base[kMaxGroups + 1] = {};

  constexpr std::int64_t device_blocks() const { return device_base[num_groups]; }
  constexpr std::int64_t host_blocks() const { return host_base[num_groups]; }
  // The group whose device (host) ids hold `id`; -1 when it is outside every group.
  constexpr std::int32_t device_group(std::int64_t id) const { return find(device_base, id); }
  constexpr std::int32_t host_group(std::int64_t id) const { return find(host_base, id); }

 private:
  constexpr std::int32_t find(const std::int64_t* base, std::int64_t id) const {
    for (std::uint32_t g = 0; g < num_groups; ++g)
      if (id >= base[g] && id < base[g + 1]) return static_cast<std::int32_t>(g);
    return -1;
  }
};

// The id space of a group list that passed geometry_problem (totals below 2^31).
constexpr GroupIdSpace id_space(const CacheGroups& gs) {
  GroupIdSpace s;
  s.num_groups = gs.num_groups < kMaxGroups ? gs.num_groups : kMaxGroups;
  for (std::uint32_t g = 0; g < s.num_groups; ++g) {
    s.device_base[g + 1] = s.device_base[g] + gs.groups[g].device_blocks;
    s.host_base[g + 1] = s.host_base[g] + gs.groups[g].host_blocks;
  }
  return s;
}

}  // namespace kvtd::proto
