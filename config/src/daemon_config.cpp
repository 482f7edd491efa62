#include "kvtd/config/daemon_config.h"

#include "kvtd/proto/session.h"


#include "kvtd/config/version_yaml.h"
#include "small_file.h"

#include "kvtd/base/version.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <cstdlib>
#include <sstream>

#include "kvtd/proto/names.h"

namespace kvtd::config {

namespace {
constexpr long long kMaxVersionYamlBytes = 64 * 1024;
}  // namespace

proto::CacheGeometry DaemonConfig::geometry() const {
  if (proto::is_group_session(cache_groups)) return proto::envelope_of(cache_groups);
  proto::CacheGeometry g{};
  g.num_ranks = mp_num;
  g.num_layers = num_layers + num_extra_layers;
  g.num_extra_layers = num_extra_layers;
  g.extra_device_blocks = num_extra_layers != 0 ? extra_device_blocks : 0;
  g.scale_bytes = cache_dtype == proto::CacheDtype::kBlockWiseFp8 ? scale_bytes : 0;
  g.dtype = static_cast<std::uint32_t>(cache_dtype);
  g.num_host_blocks = num_host_blocks;
  for (int i = 0; i < 4; ++i) {
    g.key_shape[i] = key_cache_shape[i];
    g.value_shape[i] = value_cache_shape[i];
  }
  return g;
}

std::string DaemonConfig::object_slicing(proto::ObjectSlicing* out) const {
  if (proto::is_group_session(cache_groups)) {  // each group is stored by rank (an MLA group once)
    *out = proto::ObjectSlicing{};
    return storage.object_heads != 0 || storage.kv_heads != 0
               ? "--storage-object-heads/--storage-kv-heads: not with --cache-group (a session of cache groups stores "
                 "each group by rank, an MLA latent group once for every TP size)"
               : "";
  }
  const proto::CacheGeometry g = geometry();
  return proto::object_slicing(g, rank, kv_layout() == proto::KvLayout::kReplicated, storage.object_heads,
                               storage.kv_heads, out);
}

proto::KvLayout DaemonConfig::kv_layout() const {
  if (proto::is_group_session(cache_groups)) return proto::KvLayout::kUndeclared;
  if (kv_identity.kv_layout() != proto::KvLayout::kUndeclared) return kv_identity.kv_layout();
  // Undeclared: FastDeploy's launch line, where an empty value cache shape is how FastDeploy itself
  // declares MLA (fastdeploy/worker/gpu_model_runner.py:1616-1629 creates no value cache then): one
  // latent, replicated. Every engine adapter declares the layout instead (a cross-layer slab has
  // no value tensor either and is per rank).
  return geometry().has_value() ? proto::KvLayout::kPerRank : proto::KvLayout::kReplicated;
}

const char* verify_swaps_name(VerifySwaps v) {
  switch (v) {
    case VerifySwaps::kOff: return "off";
    case VerifySwaps::kSampled: return "sampled";
    case VerifySwaps::kFull: return "full";
  }
  return "?";
}

bool parse_verify_swaps(const std::string& text, VerifySwaps* out) {
  for (auto v : {VerifySwaps::kOff, VerifySwaps::kSampled, VerifySwaps::kFull}) {
    if (text == verify_swaps_name(v)) {
      *out = v;
      return true;
    }
  }
  return false;
}

std::string fastdeploy_session_suffix(const std::string& engine_worker_queue_port) {
  return "fastdeploy." + engine_worker_queue_port;
}

Result<std::string, ConfigErrc> fastdeploy_key_prefix(const std::string& model_path) {
  const std::string file = model_path + "/version.yaml";
  auto bad = [&](const std::string& why) {
    return make_error(ConfigErrc::kInvalidValue, "--model_path: " + file + ": " + why);
  };
  // A FIFO or a device in its place must not hang or fill the daemon: a small regular file only.
  const SmallFile f = read_small_regular_file(file, kMaxVersionYamlBytes);
  if (f.missing) return std::string();
  if (!f.problem.empty()) return bad(f.problem);
  const std::string& text = f.text;
  auto version = version_from_yaml(text);
  if (!version.ok()) return bad(version.error().message);
  // FastDeploy uses the prefix as written; one a name cannot hold (a space, a '/', non-ASCII,
  // over 64 characters) is encoded, not refused: a distinct name per distinct prefix.
  return proto::name_of_text(key_prefix_of_version(*version), 64);
}

Result<std::vector<std::int64_t>, ConfigErrc> parse_shape(const std::string& text, const std::string& flag) {
  std::vector<std::int64_t> dims;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = text.find(',', pos);
    const std::string part = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    std::int64_t v = 0;
    const auto* b = part.data();
    const auto* e = part.data() + part.size();
    auto [p, ec] = std::from_chars(b, e, v);
    if (part.empty() || ec != std::errc() || p != e || v <= 0)
      return make_error(ConfigErrc::kInvalidValue, flag + ": '" + text + "' must be 3 or 4 positive integers like 1000,8,64,128");
    dims.push_back(v);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  if (dims.size() != 3 && dims.size() != 4)
    return make_error(ConfigErrc::kInvalidValue,
                      fmt::format("{}: '{}' has {} dimensions; expected blocks,kv_heads,block_size[,head_dim]", flag,
                                  text, dims.size()));
  // A 3-D cache: the same bytes as head_dim 1 (a new vector: GCC 12 warns on push_back here).
  if (dims.size() == 3) return std::vector<std::int64_t>{dims[0], dims[1], dims[2], 1};
  return dims;
}



}  // namespace kvtd::config
