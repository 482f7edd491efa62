// kvtd/proto/group_spec.h - one cache group as a line of text (the daemon's --cache-group flag, a
// config file's `cache-group = [...]`, the loadgen's flag), its encoder beside its parser:
//
//   kind=<kind>,layers=<ranges>,tensors=<tensor>[+<tensor>...],device_blocks=<n>,host_blocks=<n>
//       [,block_tokens=<n>][,window=<n>]
//
//   kind     full_attention | mla_latent | sliding_window | state | indexer
//   ranges   <first>[-<last>[:<step>]] joined by '/', e.g. 0-22:2 or 3-47:4 or 0/5/9
//   tensor   per block (state slot): its dims joined by 'x', '@' its element bytes, e.g. 4x16x64@2
//   block_tokens  tokens per block: every group but state (the storage page); window: sliding only
//
// The parser checks the text only; proto::geometry_problem checks the group list it builds.
//
// Pure functions: thread-safe.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtd/proto/cache_groups.h"

namespace kvtd::proto {

namespace detail {

inline bool spec_number(std::string_view s, std::uint64_t max, std::uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  std::uint64_t v = 0;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (r.ec != std::errc() || r.ptr != s.data() + s.size() || v > max) return false;
  *out = v;
  return true;
}

inline std::vector<std::string_view> spec_split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const auto at = s.find(sep);
    out.push_back(s.substr(0, at));
    if (at == std::string_view::npos) return out;
    s.remove_prefix(at + 1);
  }
}

inline std::string spec_layers(std::string_view v, CacheGroup* c) {
  for (std::string_view range : spec_split(v, '/')) {
    std::uint64_t first = 0, last = 0, step = 1;
    std::string_view bounds = range;
    if (const auto colon = range.find(':'); colon != std::string_view::npos) {
      if (!spec_number(range.substr(colon + 1), kMaxLayers, &step) || step == 0)
        return "layers: step in '" + std::string(range) + "' must be a number in [1, " + std::to_string(kMaxLayers) + "]";
      bounds = range.substr(0, colon);
    }
    const auto dash = bounds.find('-');
    if (!spec_number(bounds.substr(0, dash), kMaxLayers - 1, &first) ||
        (dash != std::string_view::npos && !spec_number(bounds.substr(dash + 1), kMaxLayers - 1, &last)))
      return "layers: '" + std::string(range) + "' must be <first>[-<last>[:<step>]] of layers below " +
             std::to_string(kMaxLayers);
    if (dash == std::string_view::npos) last = first;
    if (last < first) return "layers: '" + std::string(range) + "' ends before it starts";
    for (std::uint64_t l = first; l <= last; l += step) c->add_layer(static_cast<std::uint32_t>(l));
  }
  return "";
}

inline std::string spec_tensors(std::string_view v, CacheGroup* c) {
  const auto list = spec_split(v, '+');
  if (list.size() > kMaxGroupTensors) return "tensors: at most " + std::to_string(kMaxGroupTensors) + " per layer";
  for (std::string_view one : list) {
    GroupTensor& t = c->tensors[c->num_tensors];
    const auto at = one.find('@');
    std::uint64_t elem = 0;
    if (at == std::string_view::npos || !spec_number(one.substr(at + 1), 8, &elem))
      return "tensors: '" + std::string(one) + "' must be <dims joined by x>@<element bytes>";
    const auto dims = spec_split(one.substr(0, at), 'x');
    if (dims.size() > kMaxGroupTensorDims)
      return "tensors: '" + std::string(one) + "' has more than " + std::to_string(kMaxGroupTensorDims) + " dims";
    for (std::string_view d : dims) {
      std::uint64_t n = 0;
      if (!spec_number(d, std::uint64_t{1} << 40, &n)) return "tensors: dim '" + std::string(d) + "' is not a number";
      t.dims[t.ndim++] = static_cast<std::int64_t>(n);
    }
    t.element_bytes = static_cast<std::uint32_t>(elem);
    ++c->num_tensors;
  }
  return "";
}

}  // namespace detail

// Parses one spec into *out (zeroed first): "" or the first problem, naming the key.
inline std::string parse_group_spec(std::string_view spec, CacheGroup* out) {
  *out = CacheGroup{};
  bool kind = false, layers = false, tensors = false, device = false, host = false;
  std::vector<std::string_view> keys;
  for (std::string_view item : detail::spec_split(spec, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string_view::npos) return "'" + std::string(item) + "' is not key=value";
    const std::string_view key = item.substr(0, eq), v = item.substr(eq + 1);
    for (std::string_view k : keys)
      if (k == key) return "key '" + std::string(key) + "' is given twice";
    keys.push_back(key);
    std::uint64_t n = 0;
    if (key == "kind") {
      out->kind = static_cast<std::uint32_t>(group_kind_from_name(v));
      if (out->group_kind() == GroupKind::kInvalid) return "kind '" + std::string(v) + "' is not a group kind";
      kind = true;
    } else if (key == "layers") {
      if (auto why = detail::spec_layers(v, out); !why.empty()) return why;
      layers = true;
    } else if (key == "tensors") {
      if (auto why = detail::spec_tensors(v, out); !why.empty()) return why;
      tensors = true;
    } else if (key == "device_blocks" || key == "host_blocks" || key == "block_tokens" || key == "window") {
      if (!detail::spec_number(v, INT32_MAX, &n)) return std::string(key) + " '" + std::string(v) + "' must be a number below 2^31";
      if (key == "device_blocks") out->device_blocks = static_cast<std::int64_t>(n), device = true;
      if (key == "host_blocks") out->host_blocks = static_cast<std::uint32_t>(n), host = true;
      if (key == "block_tokens") out->block_tokens = static_cast<std::uint32_t>(n);
      if (key == "window") out->window_tokens = static_cast<std::uint32_t>(n);
    } else {
      return "unknown key '" + std::string(key) + "'";
    }
  }
  if (!kind || !layers || !tensors || !device || !host)
    return std::string("missing ") + (!kind ? "kind" : !layers ? "layers" : !tensors ? "tensors" : !device ? "device_blocks" : "host_blocks");
  return "";
}

// The spec of `c`: parse_group_spec(format_group_spec(c)) gives c back (its layers as single
// layers and runs with a step).
inline std::string format_group_spec(const CacheGroup& c) {
  std::string out = std::string("kind=") + group_kind_name(c.group_kind()) + ",layers=";
  std::vector<std::uint32_t> ls;
  for (std::uint32_t l = 0; l < kMaxLayers; ++l)
    if (c.has_layer(l)) ls.push_back(l);
  bool first = true;
  for (std::size_t i = 0; i < ls.size();) {
    std::size_t j = i;  // the longest run with one step from ls[i]
    const std::uint32_t step = i + 1 < ls.size() ? ls[i + 1] - ls[i] : 1;
    while (j + 1 < ls.size() && ls[j + 1] - ls[j] == step) ++j;
    out += first ? "" : "/";
    first = false;
    out += std::to_string(ls[i]);
    if (j > i) out += "-" + std::to_string(ls[j]) + (step != 1 ? ":" + std::to_string(step) : "");
    i = j + 1;
  }
  out += ",tensors=";
  for (std::uint32_t t = 0; t < c.num_tensors && t < kMaxGroupTensors; ++t) {
    if (t != 0) out += "+";
    for (std::uint32_t d = 0; d < c.tensors[t].ndim && d < kMaxGroupTensorDims; ++d)
      out += (d != 0 ? "x" : "") + std::to_string(c.tensors[t].dims[d]);
    out += "@" + std::to_string(c.tensors[t].element_bytes);
  }
  out += ",device_blocks=" + std::to_string(c.device_blocks) + ",host_blocks=" + std::to_string(c.host_blocks);
  if (c.block_tokens != 0) out += ",block_tokens=" + std::to_string(c.block_tokens);
  if (c.window_tokens != 0) out += ",window=" + std::to_string(c.window_tokens);
  return out;
}

// The group list of `specs` for `num_ranks` ranks, page_tokens from the block groups: "" or the
// first problem, naming the spec (geometry_problem then checks the whole list).
inline std::string groups_from_specs(const std::vector<std::string>& specs, std::uint32_t num_ranks, CacheGroups* out) {
  *out = CacheGroups{};
  out->num_ranks = num_ranks;
  if (specs.size() > kMaxGroups) return "at most " + std::to_string(kMaxGroups) + " cache groups";
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (auto why = parse_group_spec(specs[i], &out->groups[i]); !why.empty())
      return "cache group " + std::to_string(i) + ": " + why;
    if (out->page_tokens == 0) out->page_tokens = out->groups[i].block_tokens;
  }
  out->num_groups = static_cast<std::uint32_t>(specs.size());
  if (out->page_tokens == 0 && !specs.empty())
    return "no group has block_tokens: give each block group (all kinds but state) block_tokens=<tokens per block>";
  return geometry_problem(*out);
}

}  // namespace kvtd::proto
