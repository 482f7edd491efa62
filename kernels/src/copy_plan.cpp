#include "kvtd/kernels/copy_plan.h"

#include <limits>
#include <string>

namespace kvtd::kernels {
namespace {

// Bitmap of destination blocks seen by the current call. Kept per thread and cleared bit by bit
// after use, so planning a small task in a large cache never zeroes the whole map.
struct DestinationBitmap {
  std::vector<std::uint64_t> words;

  void ensure(std::int64_t blocks) {
    const auto need = static_cast<std::size_t>((blocks + 63) / 64);
    if (words.size() < need) words.resize(need, 0);
  }
  bool test_and_set(std::int32_t id) {
    auto& w = words[static_cast<std::uint32_t>(id) >> 6];
    const std::uint64_t bit = std::uint64_t{1} << (static_cast<std::uint32_t>(id) & 63u);
    const bool was = (w & bit) != 0;
    w |= bit;
    return was;
  }
  void clear(std::span<const std::int32_t> ids) {
    for (auto id : ids) {
      if (id >= 0 && static_cast<std::size_t>(id >> 6) < words.size()) words[static_cast<std::uint32_t>(id) >> 6] = 0;
    }
  }
};

thread_local DestinationBitmap t_seen;

std::string pair_text(std::size_t i, std::int32_t s, std::int32_t d) {
  return "pair " + std::to_string(i) + " (src " + std::to_string(s) + ", dst " + std::to_string(d) + ")";
}

}  // namespace

const char* plan_errc_name(PlanErrc e) {
  switch (e) {
    case PlanErrc::kLengthMismatch: return "length_mismatch";
    case PlanErrc::kSourceOutOfRange: return "source_out_of_range";
    case PlanErrc::kDestinationOutOfRange: return "destination_out_of_range";
    case PlanErrc::kDuplicateDestination: return "duplicate_destination";
    case PlanErrc::kSizeOverflow: return "size_overflow";
  }
  return "unknown";
}

Result<CopyPlan, PlanErrc> plan_copy(std::span<const std::int32_t> src, std::span<const std::int32_t> dst,
                                     std::int64_t src_blocks, std::int64_t dst_blocks,
                                     std::span<const std::uint64_t> block_bytes) {
  if (src.size() != dst.size()) {
    return make_error(PlanErrc::kLengthMismatch, "source list has " + std::to_string(src.size()) +
                                                     " ids but destination list has " +
                                                     std::to_string(dst.size()));
  }
  if (src_blocks < 0 || dst_blocks < 0 || src_blocks > std::numeric_limits<std::int32_t>::max() ||
      dst_blocks > std::numeric_limits<std::int32_t>::max()) {
    return make_error(PlanErrc::kSizeOverflow, "block counts must be in [0, 2^31)");
  }
  const auto max_blocks = static_cast<std::uint64_t>(src_blocks > dst_blocks ? src_blocks : dst_blocks);
  for (std::size_t t = 0; t < block_bytes.size(); ++t) {
    if (block_bytes[t] != 0 && max_blocks > std::numeric_limits<std::uint64_t>::max() / block_bytes[t]) {
      return make_error(PlanErrc::kSizeOverflow, "tensor " + std::to_string(t) + ": " +
                                                     std::to_string(max_blocks) + " blocks of " +
                                                     std::to_string(block_bytes[t]) +
                                                     " bytes overflow 64 bits");
    }
  }

  CopyPlan plan;
  plan.num_blocks = static_cast<std::int64_t>(src.size());
  if (src.empty()) return plan;

  t_seen.ensure(dst_blocks);
  const std::size_t n = src.size();
  std::size_t i = 0;
  for (; i < n; ++i) {
    const std::int32_t s = src[i];
    const std::int32_t d = dst[i];
    if (s < 0 || s >= src_blocks) {
      t_seen.clear(dst.first(i));
      return make_error(PlanErrc::kSourceOutOfRange, pair_text(i, s, d) + ": source id outside [0, " +
                                                         std::to_string(src_blocks) + ")");
    }
    if (d < 0 || d >= dst_blocks) {
      t_seen.clear(dst.first(i));
      return make_error(PlanErrc::kDestinationOutOfRange, pair_text(i, s, d) +
                                                              ": destination id outside [0, " +
                                                              std::to_string(dst_blocks) + ")");
    }
    if (t_seen.test_and_set(d)) {
      t_seen.clear(dst.first(i));
      return make_error(PlanErrc::kDuplicateDestination,
                        pair_text(i, s, d) + ": destination block already written by an earlier pair");
    }
  }
  t_seen.clear(dst);

  // Merge maximal runs in one pass.
  std::size_t start = 0;
  for (i = 1; i <= n; ++i) {
    const bool continues = i < n && src[i] == src[i - 1] + 1 && dst[i] == dst[i - 1] + 1;
    if (continues) continue;
    const std::size_t len = i - start;
    if (len >= 2) {
      plan.runs.push_back(CopyRun{src[start], dst[start], static_cast<std::int32_t>(len)});
    } else {
      plan.single_src.push_back(src[start]);
      plan.single_dst.push_back(dst[start]);
    }
    start = i;
  }
  return plan;
}

CopyPlan singles_only(const CopyPlan& plan) {
  CopyPlan out;
  out.num_blocks = plan.num_blocks;
  out.single_src.reserve(static_cast<std::size_t>(plan.num_blocks));
  out.single_dst.reserve(static_cast<std::size_t>(plan.num_blocks));
  for (const CopyRun& r : plan.runs)
    for (std::int32_t k = 0; k < r.count; ++k) {
      out.single_src.push_back(r.src + k);
      out.single_dst.push_back(r.dst + k);
    }
  out.single_src.insert(out.single_src.end(), plan.single_src.begin(), plan.single_src.end());
  out.single_dst.insert(out.single_dst.end(), plan.single_dst.begin(), plan.single_dst.end());
  return out;
}

}  // namespace kvtd::kernels
