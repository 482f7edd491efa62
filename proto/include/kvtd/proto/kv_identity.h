// kvtd/proto/kv_identity.h - what an engine declares its KV to be, beyond its shape: whether
// every rank holds the same bytes, the element type its kernels read, and the pipeline stage and
// context-parallel slice of the model the rank holds.
//
// Shapes alone do not tell two caches apart: a float16 and a bfloat16 cache of one model have
// the same bytes per block, two pipeline stages of equal depth the same tensors, and a cache with
// no value tensor is an MLA latent (the same bytes on every rank) in FastDeploy's launch line but a
// cross-layer slab (each rank its own heads) in vLLM's. The identity enters the storage namespace
// (a different identity never reads another's objects) and the session, where a daemon whose
// flags declare another identity is refused at attach: the engine and its daemons agree, or
// nothing moves.
//
// Standard layout, in the session header (written by the engine before publish, never after).
// Values; the functions are pure.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

namespace kvtd::proto {

// How the KV is spread over tensor-parallel ranks.
enum class KvLayout : std::uint32_t {
  kUndeclared = 0,  // FastDeploy's launch line: a cache without a value tensor is an MLA latent
  kPerRank = 1,     // each rank its own bytes (its heads; a cross-layer slab): stored by rank
  kReplicated = 2,  // every rank the same bytes (an MLA latent): rank 0 stores, every rank reads
};
inline constexpr std::uint32_t kLastKvLayout = 2;

constexpr const char* kv_layout_name(KvLayout l) {
  switch (l) {
    case KvLayout::kUndeclared: return "undeclared";
    case KvLayout::kPerRank: return "per_rank";
    case KvLayout::kReplicated: return "replicated";
  }
  return "?";
}

inline constexpr std::size_t kKvDtypeChars = 16;  // NUL-padded, at most 15 characters

struct KvIdentity {
  std::uint32_t layout;           // KvLayout
  char dtype[kKvDtypeChars];      // the engine's element type name ("bfloat16", "float8_e4m3fn"); "" undeclared
  std::uint16_t pp_rank, pp_size; // pipeline stage of this session's layers (0, 0 or 0, 1: no pipeline)
  std::uint16_t cp_rank, cp_size; // context-parallel slice of every page (0, 0 or 0, 1: none)

  constexpr KvLayout kv_layout() const { return static_cast<KvLayout>(layout); }
  std::string dtype_name() const { return std::string(dtype, strnlen(dtype, kKvDtypeChars)); }
  // A stage or slice the namespace must carry (one of more than one).
  constexpr bool staged() const { return pp_size > 1 || cp_size > 1; }
};
static_assert(std::is_standard_layout_v<KvIdentity> && std::is_trivially_copyable_v<KvIdentity>);
static_assert(sizeof(KvIdentity) == 28);

// A dtype name an identity can carry: 1-15 of [a-z0-9_] (torch's and the engines' spellings).
constexpr bool valid_kv_dtype(std::string_view s) {
  if (s.empty() || s.size() >= kKvDtypeChars) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

// "" or the first problem of `id`, in words naming the field.
inline std::string kv_identity_problem(const KvIdentity& id) {
  if (id.layout > kLastKvLayout) return "kv layout " + std::to_string(id.layout) + " is not a layout";
  const std::string dtype = id.dtype_name();
  if (!dtype.empty() && !valid_kv_dtype(dtype)) return "kv dtype '" + dtype + "' must be 1-15 of [a-z0-9_]";
  for (std::size_t i = dtype.size(); i < kKvDtypeChars; ++i)
    if (id.dtype[i] != '\0') return "kv dtype is not NUL-padded";
  auto coordinate = [](const char* what, std::uint32_t rank, std::uint32_t size) -> std::string {
    if (size == 0 && rank == 0) return "";
    if (size == 0 || rank >= size)
      return std::string(what) + " rank " + std::to_string(rank) + " is not a rank of " + std::to_string(size);
    return "";
  };
  if (auto why = coordinate("pipeline", id.pp_rank, id.pp_size); !why.empty()) return why;
  return coordinate("context-parallel", id.cp_rank, id.cp_size);
}

// Sets `id`'s dtype to `name` (already valid_kv_dtype, or "" for none).
inline void set_kv_dtype(KvIdentity* id, std::string_view name) {
  std::memset(id->dtype, 0, kKvDtypeChars);
  std::memcpy(id->dtype, name.data(), name.size() < kKvDtypeChars ? name.size() : kKvDtypeChars - 1);
}

// The identity as the namespace sees it: a size of 0 means 1 (no stage, no slice).
constexpr std::uint16_t stage_size(std::uint16_t size) { return size == 0 ? 1 : size; }

// "" when a daemon whose flags declare `flags` may serve a session declaring `session`, else the
// difference in words naming the daemon's flag. `flags_layout` is the layout the daemon acts on
// (its --kv-layout, or what it infers). An undeclared session layout takes the daemon's.
inline std::string kv_identity_mismatch(const KvIdentity& session, KvLayout flags_layout, const KvIdentity& flags) {
  if (session.kv_layout() != KvLayout::kUndeclared && session.kv_layout() != flags_layout)
    return std::string("the KV layout: the engine declares ") + kv_layout_name(session.kv_layout()) +
           ", this daemon acts on " + kv_layout_name(flags_layout) + " (--kv-layout " +
           kv_layout_name(session.kv_layout()) + ")";
  if (session.dtype_name() != flags.dtype_name())
    return "the KV dtype: the engine declares '" + session.dtype_name() + "', flags say '" + flags.dtype_name() +
           "' (--kv-dtype)";
  auto stage = [](const char* what, const char* flag, std::uint32_t sr, std::uint32_t ss, std::uint32_t fr,
                  std::uint32_t fs) -> std::string {
    if (sr == fr && stage_size(static_cast<std::uint16_t>(ss)) == stage_size(static_cast<std::uint16_t>(fs))) return "";
    return std::string("the ") + what + ": the engine's session is rank " + std::to_string(sr) + " of " +
           std::to_string(stage_size(static_cast<std::uint16_t>(ss))) + ", flags say " + std::to_string(fr) + " of " +
           std::to_string(stage_size(static_cast<std::uint16_t>(fs))) + " (" + flag + ")";
  };
  if (auto why = stage("pipeline stage", "--pp-rank/--pp-size", session.pp_rank, session.pp_size, flags.pp_rank,
                       flags.pp_size);
      !why.empty())
    return why;
  return stage("context-parallel slice", "--cp-rank/--cp-size", session.cp_rank, session.cp_size, flags.cp_rank,
               flags.cp_size);
}

}  // namespace kvtd::proto
