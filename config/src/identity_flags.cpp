// The KV identity flags (kvtd/proto/kv_identity.h): what the engine's KV is beyond its shape.
// Each enters the storage namespace and must equal what the engine's session declares.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "flag_groups.h"
#include "raw_flags.h"
#include "kvtd/proto/session.h"

namespace kvtd::config {

void declare_identity_flags(CLI::App& app, RawFlags& f) {
  app.add_option("--kv-layout", f.kv_layout,
                 "per_rank (each rank its own KV: heads, a cross-layer slab) | replicated (an MLA latent, the same "
                 "bytes on every rank). Default: replicated when there is no --value-cache-shape (FastDeploy's "
                 "launch line), else per_rank. Engine adapters always give it");
  app.add_option("--kv-dtype", f.kv_dtype,
                 "The engine's KV element type by its own name (bfloat16, float8_e4m3fn, ...): part of the storage "
                 "namespace; must equal the session's");
  app.add_option("--pp-rank", f.pp_rank, "Pipeline stage of this rank's layers (with --pp-size)");
  app.add_option("--pp-size", f.pp_size, "Pipeline stages of the deployment (1: none)");
  app.add_option("--cp-rank", f.cp_rank, "Context-parallel slice this rank holds of every page (with --cp-size)");
  app.add_option("--cp-size", f.cp_size, "Context-parallel slices of the deployment (1: none)");
}

Status<ConfigErrc> resolve_identity(const RawFlags& f, DaemonConfig& c) {
  proto::KvIdentity& id = c.kv_identity;
  id = proto::KvIdentity{};
  const bool groups = proto::is_group_session(c.cache_groups);
  if (f.kv_layout == "per_rank") id.layout = static_cast<std::uint32_t>(proto::KvLayout::kPerRank);
  else if (f.kv_layout == "replicated") id.layout = static_cast<std::uint32_t>(proto::KvLayout::kReplicated);
  else if (!f.kv_layout.empty()) return bad("--kv-layout: '" + f.kv_layout + "' is not one of per_rank, replicated");
  if (groups && !f.kv_layout.empty())
    return bad("--kv-layout: not with --cache-group (each group's kind declares it: kind=mla_latent is replicated)");
  if (!f.kv_dtype.empty() && !proto::valid_kv_dtype(f.kv_dtype))
    return bad("--kv-dtype: '" + f.kv_dtype + "' must be 1-15 of [a-z0-9_] (e.g. bfloat16, float8_e4m3fn)");
  proto::set_kv_dtype(&id, f.kv_dtype);
  auto stage = [](const char* name, std::int64_t rank, std::int64_t size, std::uint16_t* r,
                  std::uint16_t* s) -> Status<ConfigErrc> {
    if (size < 1 || size > 1024)
      return bad(fmt::format("--{}-size: {} must be in [1, 1024]", name, size));
    if (rank < 0 || rank >= size)
      return bad(fmt::format("--{}-rank: {} is not a rank of --{}-size {}", name, rank, name, size));
    *r = static_cast<std::uint16_t>(rank);
    *s = static_cast<std::uint16_t>(size);
    return {};
  };
  KVTD_TRY(stage("pp", f.pp_rank, f.pp_size, &id.pp_rank, &id.pp_size));
  KVTD_TRY(stage("cp", f.cp_rank, f.cp_size, &id.cp_rank, &id.cp_size));
  return {};
}

}  // namespace kvtd::config
