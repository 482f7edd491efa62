// libFuzzer target: cache groups and object slicing on arbitrary bytes, as a hostile engine could
// write them into shared memory or the C ABI. Whatever geometry_problem accepts must size without
// overflow and answer a loadable prefix that every group's rule holds at, with no longer one that
// does, and place each group's tensors in a layer's slots exactly once and its blocks inside one
// id space below 2^31; whatever object_slicing accepts must cut the rank's heads exactly; a group
// spec the parser accepts must come back unchanged from its encoder.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "kvtd/proto/cache_groups.h"
#include "kvtd/proto/group_hits.h"
#include "kvtd/proto/group_slots.h"
#include "kvtd/proto/group_spec.h"
#include "kvtd/proto/object_slices.h"

namespace {

using namespace kvtd::proto;

void check_groups(const std::uint8_t* data, std::size_t size) {
  CacheGroups gs{};
  std::memcpy(&gs, data, std::min(size, sizeof gs));
  if (!geometry_problem(gs).empty()) return;
  const GroupSizes s = group_sizes(gs);
  if (s.problem != nullptr || s.host_pool_total >= kMaxSizeBytes) std::abort();
  // Presence: the bytes after the groups, one bit per (group, key).
  const std::uint8_t* bits = data + std::min(size, sizeof gs);
  const std::size_t nbits = (size - std::min(size, sizeof gs)) * 8;
  const std::uint32_t keys = static_cast<std::uint32_t>(std::min<std::size_t>(nbits / gs.num_groups, 256));
  auto present = [&](std::uint32_t g, std::uint32_t k) {
    const std::size_t bit = std::size_t{g} * keys + k;
    return (bits[bit / 8] >> (bit % 8)) & 1;
  };
  auto holds = [&](std::uint32_t p) {
    for (std::uint32_t g = 0; g < gs.num_groups; ++g) {
      const std::uint32_t need = trailing_pages(gs.groups[g], gs.page_tokens);
      const std::uint32_t from = need == 0 ? 0 : p - std::min(need, p);
      for (std::uint32_t k = from; k < p; ++k)
        if (!present(g, k)) return false;
    }
    return true;
  };
  // Slots: each group's tensor t once in each of its layers, nothing else.
  const GroupIdSpace ids = id_space(gs);
  if (ids.device_blocks() > INT32_MAX || ids.host_blocks() > INT32_MAX) std::abort();
  for (std::uint32_t l = 0; l < kMaxLayers; ++l) {
    std::uint32_t seen[kMaxGroups] = {};
    for (std::uint32_t k = 0; k < kTensorKinds; ++k) {
      const GroupSlot at = group_slot(gs, l, k);
      if (at.group < 0) continue;
      if (!gs.groups[at.group].has_layer(l) || at.tensor != seen[at.group]++) std::abort();
    }
    for (std::uint32_t g = 0; g < gs.num_groups; ++g)
      if (seen[g] != (gs.groups[g].has_layer(l) ? gs.groups[g].num_tensors : 0u)) std::abort();
  }
  const GroupHits h = loadable_prefix(gs, keys, present);
  if (h.pages > keys || !holds(h.pages)) std::abort();
  for (std::uint32_t p = h.pages + 1; p <= keys; ++p)
    if (holds(p)) std::abort();
}

void check_slicing(const std::uint8_t* data, std::size_t size) {
  if (size < sizeof(CacheGeometry) + 9) return;
  CacheGeometry g{};
  std::memcpy(&g, data, sizeof g);
  if (!geometry_problem(g).empty()) return;
  std::uint32_t rank = 0, object_heads = 0, kv_heads = 0;
  std::memcpy(&rank, data + sizeof g, 4);
  std::memcpy(&object_heads, data + sizeof g + 4, 4);
  kv_heads = data[sizeof g + 8];
  rank %= g.num_ranks;
  object_heads %= 4097;
  ObjectSlicing s;
  if (!object_slicing(g, rank, !g.has_value(), object_heads, kv_heads, &s).empty()) return;
  if (s.parts == 0) std::abort();
  if (s.by_head) {
    if (static_cast<std::uint64_t>(s.parts) * s.heads_per_part != static_cast<std::uint64_t>(g.key_shape[1]))
      std::abort();
    if (static_cast<std::uint64_t>(s.first_head) + g.key_shape[1] > s.total_heads) std::abort();
  } else if (s.parts != 1) {
    std::abort();
  }
}

void check_spec(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  CacheGroup c{};
  if (!parse_group_spec(text, &c).empty()) return;
  CacheGroup back{};
  const std::string again = format_group_spec(c);
  if (!parse_group_spec(again, &back).empty() || std::memcmp(&back, &c, sizeof c) != 0) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  if (data[0] & 1) check_slicing(data + 1, size - 1);
  else if (data[0] & 2) check_spec(data + 1, size - 1);
  else check_groups(data + 1, size - 1);
  return 0;
}
