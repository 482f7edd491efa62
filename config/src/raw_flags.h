// raw_flags.h (config internal) - the daemon's command line as CLI11 read it, before the flag
// groups check it and turn it into a DaemonConfig (daemon_flags.cpp, storage_flags.cpp), and the
// two helpers every group's messages use.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "kvtd/config/daemon_config.h"

namespace kvtd::config {

// The command line's values before they are checked, and the options whose presence matters.
struct RawFlags {
  std::int64_t rank = 0, mp_num = 1, dp_id = 0, device_base = 0, num_layers = 1, host_blocks = 0;
  std::string device_id = "0", instance, config_dir;
  CLI::Option* rank_opt = nullptr;
  std::int64_t extra_layers = -1, extra_blocks = -1;
  std::vector<std::string> cache_groups;  // --cache-group, one per group
  std::vector<CLI::Option*> single_shape_opts;  // what --cache-group replaces (refused beside it)
  std::string key_shape, value_shape, dtype = "bfloat16", default_dtype = "bfloat16", speculative_json;
  // FastDeploy 2.0/2.1 described the cache by these instead of the shapes (key and value alike).
  std::int64_t fd_gpu_blocks = 0, fd_kv_heads = 0, fd_block_size = 0, fd_head_dim = 0;
  CLI::Option *fd_blocks_opt = nullptr, *fd_heads_opt = nullptr, *fd_bs_opt = nullptr, *fd_hd_opt = nullptr;
  std::string suffix, backend = "host", scatter = "batch", host_layout = "layer_first", numa = "auto";
  std::string verify_swaps = "sampled";
  CLI::Option *backend_opt = nullptr, *scatter_opt = nullptr, *model_id_opt = nullptr, *io_threads_opt = nullptr;
  std::int64_t metrics_port = 0;
  std::string engine_pid;
  std::string storage_backend = "none", write_policy, fsync = "none", redis_endpoints, storage_io = "buffered";
  std::string ignored_s;
  std::string kv_layout, kv_dtype;  // --kv-layout, --kv-dtype ("": not given)
  std::int64_t pp_rank = 0, pp_size = 1, cp_rank = 0, cp_size = 1;
  std::vector<CLI::Option*> compat_opts;
};

inline Error<ConfigErrc> bad(const std::string& m) { return make_error(ConfigErrc::kInvalidValue, m); }

// Seconds in a message. Range checks on doubles are written so that NaN fails every one.
inline std::string seconds(double v) { return std::to_string(v); }

}  // namespace kvtd::config
