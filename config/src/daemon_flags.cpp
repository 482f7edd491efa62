// The daemon's command line: every flag declared (by group), parsed by CLI11, then checked and
// turned into a DaemonConfig group by group, each error naming its flag.
#include <arpa/inet.h>
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <charconv>
#include <cstdlib>
#include <sstream>

#include "kvtd/base/log_levels.h"
#include "kvtd/base/version.h"
#include "kvtd/config/daemon_config.h"
#include "kvtd/proto/group_spec.h"
#include "kvtd/proto/session.h"
#include "kvtd/proto/names.h"
#include "flag_groups.h"
#include "kvtd/proto/object_slices.h"
#include "raw_flags.h"
#include "instance.h"

namespace kvtd::config {
namespace {

// Dotted-quad IPv4 (inet_pton's rule: four decimal fields of 0-255).
bool is_ipv4_address(const std::string& s) {
  in_addr a{};
  return inet_pton(AF_INET, s.c_str(), &a) == 1;
}

// Extra (MTP) layers from --num-extra-layers/--extra-device-blocks, else from FastDeploy's
// --speculative_config JSON (num_extra_cache_layer; device blocks = main blocks x
// num_gpu_block_expand_ratio, truncated as FastDeploy does). The explicit flags win.
Status<ConfigErrc> extra_layers_from(const std::string& json_text, std::int64_t layers, std::int64_t blocks,
                                     std::int64_t main_blocks, DaemonConfig* c) {
  std::int64_t json_layers = 0;
  double ratio = 1.0;
  if (!json_text.empty()) {
    try {
      const auto j = nlohmann::json::parse(json_text);
      if (!j.is_object()) return bad("--speculative_config: '" + json_text + "' is not a JSON object");
      if (auto it = j.find("num_extra_cache_layer"); it != j.end() && !it->is_null()) {
        if (!it->is_number_integer()) return bad("--speculative_config: num_extra_cache_layer must be an integer");
        json_layers = it->get<std::int64_t>();
      }
      if (auto it = j.find("num_gpu_block_expand_ratio"); it != j.end() && !it->is_null()) {
        if (!it->is_number()) return bad("--speculative_config: num_gpu_block_expand_ratio must be a number");
        ratio = it->get<double>();
      }
    } catch (const std::exception& e) {
      return bad("--speculative_config: '" + json_text + "' is not valid JSON (" + e.what() + ")");
    }
  }
  const std::int64_t n = layers >= 0 ? layers : json_layers;
  if (n < 0 || n > static_cast<std::int64_t>(proto::kMaxLayers))
    return bad(fmt::format("extra layers: {} must be in [0, {}]", n, proto::kMaxLayers));
  c->num_extra_layers = static_cast<std::uint32_t>(n);
  if (n == 0) {
    if (blocks > 0) return bad("--extra-device-blocks needs --num-extra-layers");
    return {};
  }
  if (blocks >= 0) {
    c->extra_device_blocks = blocks;
  } else {
    // Written so that NaN and infinities fail.
    if (!(ratio > 0 && ratio <= 64))
      return bad(fmt::format("--speculative_config: num_gpu_block_expand_ratio {:f} must be in (0, 64]", ratio));
    c->extra_device_blocks = static_cast<std::int64_t>(static_cast<double>(main_blocks) * ratio);
  }
  if (c->extra_device_blocks < 1 || c->extra_device_blocks > INT32_MAX)
    return bad(fmt::format("extra layers' device blocks {} must be in [1, 2^31)", c->extra_device_blocks));
  return {};
}

// Rank, device, layers, shapes and dtypes.
void declare_rank_flags(CLI::App& app, RawFlags& f) {
  f.rank_opt = app.add_option("--rank", f.rank, "Tensor-parallel rank served by this process (or --instance)");
  app.add_option("--instance", f.instance,
                 "systemd instance: <rank>, or <group>-<rank> for one of several engines on this host");
  app.add_option("--config-dir", f.config_dir,
                 "With --instance: read flags from <dir>/kvtd.toml, or <dir>/<group>.toml for a group");
  app.add_option("--mp-num,--mp_num", f.mp_num, "Number of tensor-parallel ranks");
  app.add_option("--local-data-parallel-id,--local_data_parallel_id", f.dp_id,
                 "Data-parallel group of this rank (log file kvtd_dp<id>_rank<rank>.log)");
  app.add_option("--device-id,--device_id", f.device_id,
                 "CUDA device ordinal of this rank, or auto: --device-base + rank");
  app.add_option("--device-base", f.device_base, "First device of this group (for --device-id auto)");
  f.single_shape_opts.push_back(app.add_option("--num-layers,--num_layers", f.num_layers, "Model layers with a KV cache (extra MTP layers not counted)"));
  app.add_option("--num-extra-layers", f.extra_layers, "Extra (MTP / speculative) cache layers after the model's");
  app.add_option("--extra-device-blocks", f.extra_blocks, "Device blocks of each extra layer (default: the key shape's)");
  app.add_option("--speculative-config,--speculative_config", f.speculative_json,
                 "FastDeploy JSON: num_extra_cache_layer, num_gpu_block_expand_ratio");
  app.add_option("--default-dtype,--default_dtype", f.default_dtype,
                 "block_wise_fp8 scale elements: bfloat16 | float16 (2 bytes) | float32 (4 bytes)");
  f.single_shape_opts.push_back(
      app.add_option("--num-host-blocks,--num_cpu_blocks", f.host_blocks, "Blocks in the pinned host pool"));
  app.add_option("--cache-group", f.cache_groups,
                 "One cache group (repeat per group; replaces --key-cache-shape and --num-layers): "
                 "kind=...,layers=...,tensors=...,device_blocks=N,host_blocks=N[,block_tokens=N][,window=N]")
      ->take_all();
  app.add_option("--key-cache-shape,--key_cache_shape", f.key_shape,
                 "blocks,kv_heads,block_size,head_dim (required, or FastDeploy 2.0/2.1's four flags below)");
  // FastDeploy 2.0/2.1 described the cache by these instead of the shapes (key and value alike).
  f.fd_blocks_opt = app.add_option("--num_gpu_blocks", f.fd_gpu_blocks, "FastDeploy 2.0/2.1: device blocks");
  f.fd_heads_opt = app.add_option("--kv_num_head", f.fd_kv_heads, "FastDeploy 2.0/2.1: KV heads per rank");
  f.fd_bs_opt = app.add_option("--block_size", f.fd_block_size, "FastDeploy 2.0/2.1: tokens per block");
  f.fd_hd_opt = app.add_option("--head_dim", f.fd_head_dim, "FastDeploy 2.0/2.1: head dimension");
  app.add_option("--value-cache-shape,--value_cache_shape", f.value_shape, "Same as key; omit for MLA (no value cache)");
  f.single_shape_opts.push_back(
      app.add_option("--cache-dtype,--cache_dtype", f.dtype, "bfloat16 | float16 | uint8 | block_wise_fp8"));
}

// Session, backends, host pool, logging, control, metrics, timeouts, model id, FastDeploy names.
void declare_runtime_flags(CLI::App& app, RawFlags& f, DaemonConfig& c) {
  app.add_option("--session,--ipc-suffix,--ipc_suffix", f.suffix,
                 "Session suffix shared with the engine (default with FastDeploy's flags: "
                 "fastdeploy.<engine_worker_queue_port>)");
  f.backend_opt = app.add_option("--device-backend", f.backend,
                                     "cuda | host (default: $KVTD_DEVICE_BACKEND, else cuda when launched with "
                                     "FastDeploy's flags, else host)");
  f.scatter_opt = app.add_option("--scatter-mode", f.scatter,
                                     "CUDA: batch (default: copy engines) | kernel | kernel-per-layer | memcpy "
                                     "(scattered blocks)");
  app.add_option("--verify-swaps", f.verify_swaps,
                 "Checksums of swapped blocks, taken where the device blocks are on the way out and checked after the "
                 "way back in (a mismatch fails the swap-in: integrity): off | sampled (every 8th host block, "
                 "default) | full");
  app.add_option("--copy-batch-max", c.copy_batch_max,
                 "CUDA batch mode: at most this many copies per cudaMemcpyBatchAsync call (a task's are split "
                 "into calls of this size; drivers have failed on ~52K in one call)")
      ->check(CLI::Range(1u, 32768u));
  app.add_option("--copy-wait-spin-us", c.copy_wait_spin_us,
                 "CUDA: a copy lane sleeps on the host until shortly before its copy should end, then polls for "
                 "it within a window this wide, yielding the core, before it sleeps in the driver (whose wake-up "
                 "costs tens of microseconds a task); 0 (default): the driver's wait alone, which measured faster on an "
                 "H100 than a 200 us window")
      ->check(CLI::Range(0u, 100000u));
  app.add_option("--numa-node", f.numa,
                 "Host pool memory and copy threads: auto (the GPU's node from sysfs) | none | <node>");
  app.add_option("--host-layout", f.host_layout,
                 "Host pool: layer_first | page_first (all layers of a block contiguous, as stored)");
  app.add_flag("--host-pool-hugepages", c.host_pool_hugepages,
               "Host pool in huge pages: a file in the hugetlbfs mount --hugetlbfs-dir (survives a daemon restart "
               "like the /dev/shm pool; refused when the kernel has too few free: sysctl vm.nr_hugepages)");
  app.add_option("--hugetlbfs-dir", c.hugetlbfs_dir, "The hugetlbfs mount --host-pool-hugepages uses")
      ->capture_default_str();
  app.add_option("--host-pool-pin-threads", c.host_pool_pin_threads,
                 "CUDA: threads pinning the host pool in the background once its first blocks are pinned and "
                 "the daemon serves (a swap waits only for its own blocks' pieces)")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  app.add_option("--host-pool-pin-first-mib", c.host_pool_pin_first_mib,
                 "CUDA: MiB of the host pool's first blocks pinned before the daemon serves (a pool no larger is "
                 "pinned whole first)")
      ->check(CLI::Range(1u, 1u << 20))
      ->capture_default_str();
  app.add_option("--log-dir", c.log_dir, "Directory for the rotating per-rank log (default: stderr only)");
  app.add_option("--log-level", c.log_level, "trace | debug | info | warn | error | critical | off");
  app.add_option("--control-endpoint", c.control_endpoint,
                 "Also serve the control socket on tcp://127.0.0.1:<port> (always on ipc:// in the runtime dir)");
  app.add_option("--control-secret-file", c.control_secret_file,
                 "The TCP control endpoint's shared secret: first line of a 0600 file of this user (required with "
                 "--control-endpoint)");
  app.add_option("--metrics-port", f.metrics_port,
                 "Prometheus metrics on <metrics-address>:<port>/metrics, health probes on /healthz and /readyz (0 = off)");
  app.add_option("--metrics-address", c.metrics_address,
                 "IPv4 address the metrics and health server listens on (0.0.0.0: every interface, for kubelet probes)");
  app.add_option("--log-summary-period", c.log_summary_period_s,
                 "Seconds between info summaries while tasks complete (0 = none; debug: one line per task)");
  app.add_option("--engine-timeout", c.engine_timeout_s, "Seconds of engine heartbeat silence before detaching");
  app.add_option("--engine-event-timeout", c.engine_event_timeout_s,
                 "Seconds a swap waits for the engine's event while the engine lives (0 = only its liveness and the "
                 "task's deadline); then the task fails engine_event_not_fired, nothing copied");
  app.add_option("--stuck-copy-timeout", c.stuck_copy_timeout_s,
                 "Seconds after which a device copy that has not finished marks the rank stuck (log, metric, /readyz); "
                 "at twice this the daemon exits 8 for a restart (0 = never)");
  app.add_option("--attach-timeout", c.attach_timeout_s, "Seconds to wait for the session (0 = forever)");
  app.add_option("--heartbeat-period", c.heartbeat_period_s, "Seconds between rank heartbeats");
  f.model_id_opt = app.add_option("--model-id,--model_id", c.model_id, "Model id (namespaces storage keys)");
  app.add_option("--model_path", c.fastdeploy.model_path,
                 "FastDeploy: the model directory (model id = its name; RL key prefix from its version.yaml)");
  app.add_option("--engine_worker_queue_port", c.fastdeploy.engine_worker_queue_port,
                 "FastDeploy: suffix of its shared-memory signals, and of the session when --session is absent");
  app.add_option("--engine_pid", f.engine_pid,
                 "FastDeploy 2.0/2.1: the suffix of its signals and of the session (instead of the port)");
}

void declare_compat_flags(CLI::App& app, RawFlags& f, DaemonConfig& c) {
  // FastDeploy cache-transfer flags that kvtd accepts and ignores, so launch lines carry over.
  // A help group on the main app, not an option_group: CLI11 2.1.2 loops forever in an option
  // group's nested parse when a positional argument is left over (found by fuzz_config).
  const std::string compat_group = "FastDeploy compatibility (accepted, ignored)";
  for (const char* name : {"--splitwise_role", "--max_model_len", "--cache_queue_port",
                           "--enable_splitwise", "--pod_ip", "--protocol", "--rdma_port",
                           "--bytes_per_layer_per_block"}) {
    f.compat_opts.push_back(app.add_option(name, f.ignored_s, "ignored")->group(compat_group));
  }
  app.add_flag("--create_cache_tensor", c.fastdeploy.create_cache_tensor,
               "FastDeploy: make this rank's KV cache and publish it by FastDeploy's names for its worker "
               "(when the engine registers no tensors)");
}

// --rank or --instance (one of them), and the device: a number, or auto = --device-base + rank.
Status<ConfigErrc> resolve_instance(RawFlags& f, DaemonConfig& c) {
  if (f.instance.empty() == (f.rank_opt->count() == 0))
    return bad(f.instance.empty() ? "--rank or --instance: one is required"
                                  : "--rank and --instance both name the rank: give one");
  if (!f.instance.empty()) {
    auto inst = parse_instance(f.instance);
    if (!inst) return inst.error();
    f.rank = inst->rank;
    c.group = inst->group;
  }
  auto device = resolve_device_id(f.device_id, f.device_base, f.rank);
  if (!device) return device.error();
  f.device_id = std::to_string(*device);
  return {};
}

Status<ConfigErrc> resolve_ranks(RawFlags& f, DaemonConfig& c) {
  KVTD_TRY(resolve_instance(f, c));
  if (f.mp_num < 1 || f.mp_num > 16) return bad(fmt::format("--mp-num: {} must be in [1, 16]", f.mp_num));
  if (f.rank < 0 || f.rank >= f.mp_num)
    return bad(fmt::format("--rank: {} must be in [0, --mp-num={})", f.rank, f.mp_num));
  if (f.num_layers < 1 || f.num_layers > 512)
    return bad(fmt::format("--num-layers: {} must be in [1, 512]", f.num_layers));
  if (f.host_blocks < 0 || f.host_blocks > INT32_MAX)
    return bad(fmt::format("--num-host-blocks: {} must be in [0, 2^31)", f.host_blocks));
  const std::int64_t device_id = std::stoll(f.device_id);  // checked decimal by resolve_instance
  if (device_id < 0 || device_id > kMaxDeviceId)
    return bad(fmt::format("--device-id: {} must be in [0, {}]", f.device_id, kMaxDeviceId));
  if (f.dp_id < 0 || f.dp_id > 1023)
    return bad(fmt::format("--local-data-parallel-id: {} must be in [0, 1023]", f.dp_id));
  c.data_parallel_id = static_cast<std::uint32_t>(f.dp_id);
  c.rank = static_cast<std::uint32_t>(f.rank);
  c.mp_num = static_cast<std::uint32_t>(f.mp_num);
  c.num_layers = static_cast<std::uint32_t>(f.num_layers);
  c.num_host_blocks = static_cast<std::uint32_t>(f.host_blocks);
  c.device_id = static_cast<std::int32_t>(device_id);
  return {};
}

// --cache-group: the cache as groups; the single-shape flags must stay unset.
Status<ConfigErrc> resolve_groups(RawFlags& f, DaemonConfig& c) {
  if (!f.key_shape.empty() || !f.value_shape.empty() || f.fd_blocks_opt->count() != 0)
    return bad("--cache-group: describes the whole cache; leave out --key-cache-shape, --value-cache-shape and "
               "FastDeploy's shape flags");
  for (const CLI::Option* o : f.single_shape_opts)
    if (o->count() != 0)
      return bad("--cache-group: describes the whole cache (each group its layers, tensors and blocks); leave out " +
                 o->get_name());
  if (f.extra_layers > 0 || f.extra_blocks >= 0 || !f.speculative_json.empty())
    return bad("--cache-group: extra (MTP) layers are a group of their own; leave out --num-extra-layers and "
               "--speculative-config");
  if (auto why = proto::groups_from_specs(f.cache_groups, c.mp_num, &c.cache_groups); !why.empty())
    return bad("--cache-group: " + why);
  return {};
}

// What a daemon of cache groups does not serve yet: refused by name, once every flag is resolved.
Status<ConfigErrc> resolve_group_limits(const DaemonConfig& c) {
  if (!proto::is_group_session(c.cache_groups)) return {};
  if (c.fastdeploy.create_cache_tensor)
    return bad("--create_cache_tensor: not with --cache-group (FastDeploy's cache is a single shape)");
  return {};
}

Status<ConfigErrc> resolve_cache(RawFlags& f, DaemonConfig& c) {
  if (!f.cache_groups.empty()) return resolve_groups(f, c);
  const std::size_t fd_shape_flags =
      f.fd_blocks_opt->count() + f.fd_heads_opt->count() + f.fd_bs_opt->count() + f.fd_hd_opt->count();
  if (f.key_shape.empty() && fd_shape_flags == 4) {
    f.key_shape = fmt::format("{},{},{},{}", f.fd_gpu_blocks, f.fd_kv_heads, f.fd_block_size, f.fd_head_dim);
    if (f.value_shape.empty()) f.value_shape = f.key_shape;
  } else if (f.key_shape.empty()) {
    return bad(fd_shape_flags == 0 ? "--key-cache-shape: required"
                                   : "--key-cache-shape: required (or all four of FastDeploy 2.0's --num_gpu_blocks, "
                                     "--kv_num_head, --block_size, --head_dim)");
  }
  KVTD_ASSIGN_OR_RETURN(const auto ks, parse_shape(f.key_shape, "--key-cache-shape"));
  for (int i = 0; i < 4; ++i) c.key_cache_shape[i] = ks[static_cast<std::size_t>(i)];
  if (c.key_cache_shape[0] > INT32_MAX) return bad("--key-cache-shape: block count must be < 2^31");
  if (!f.value_shape.empty()) {
    KVTD_ASSIGN_OR_RETURN(const auto vs, parse_shape(f.value_shape, "--value-cache-shape"));
    for (int i = 0; i < 4; ++i) c.value_cache_shape[i] = vs[static_cast<std::size_t>(i)];
    if (c.value_cache_shape[0] != c.key_cache_shape[0])
      return bad(fmt::format("--value-cache-shape: block count {} differs from --key-cache-shape's {}",
                             c.value_cache_shape[0], c.key_cache_shape[0]));
  }

  KVTD_TRY(extra_layers_from(f.speculative_json, f.extra_layers, f.extra_blocks, c.key_cache_shape[0], &c));
  if (c.num_layers + c.num_extra_layers > proto::kMaxLayers)
    return bad(fmt::format("--num-layers {} plus {} extra layers exceed {}", c.num_layers, c.num_extra_layers,
                           proto::kMaxLayers));

  if (f.dtype == "bfloat16") c.cache_dtype = proto::CacheDtype::kBFloat16;
  else if (f.dtype == "float16") c.cache_dtype = proto::CacheDtype::kFloat16;
  else if (f.dtype == "uint8") c.cache_dtype = proto::CacheDtype::kUInt8;
  else if (f.dtype == "block_wise_fp8") c.cache_dtype = proto::CacheDtype::kBlockWiseFp8;
  else return bad("--cache-dtype: '" + f.dtype + "' is not one of bfloat16, float16, uint8, block_wise_fp8");
  // FastDeploy makes the fp8 scale tensors in its default dtype (cache manager v1: float32).
  if (f.default_dtype == "bfloat16" || f.default_dtype == "float16") c.scale_bytes = 2;
  else if (f.default_dtype == "float32") c.scale_bytes = 4;
  else if (f.default_dtype == "uint8" && c.cache_dtype != proto::CacheDtype::kBlockWiseFp8) c.scale_bytes = 2;  // unused
  else
    return bad("--default-dtype: '" + f.default_dtype + "' is not one of bfloat16, float16, float32" +
               (f.default_dtype == "uint8" ? " (uint8 scales are not supported with block_wise_fp8)" : ""));
  return {};
}

Status<ConfigErrc> resolve_devices(RawFlags& f, DaemonConfig& c) {
  // A FastDeploy launch line names no f.backend: its cache lives on the GPU. The variable lets a
  // test or a stand-in build run that same line on the host f.backend.
  if (f.backend_opt->count() == 0) {
    const char* env = std::getenv("KVTD_DEVICE_BACKEND");
    if (env != nullptr && *env != '\0') f.backend = env;
    else if (!c.fastdeploy.engine_worker_queue_port.empty()) f.backend = "cuda";
  }
  if (f.backend == "host") c.device_backend = DeviceBackendKind::kHost;
  else if (f.backend == "cuda") c.device_backend = DeviceBackendKind::kCuda;
  else return bad("--device-backend: '" + f.backend + "' is not one of cuda, host");

  c.scatter_mode_given = f.scatter_opt->count() > 0;
  if (!parse_verify_swaps(f.verify_swaps, &c.verify_swaps))
    return bad("--verify-swaps: '" + f.verify_swaps + "' is not one of off, sampled, full");
  if (!daemon::parse_scatter_mode(f.scatter, &c.scatter_mode))
    return bad("--scatter-mode: '" + f.scatter + "' is not one of kernel, kernel-per-layer, batch, memcpy");

  if (!daemon::parse_host_layout(f.host_layout, &c.host_layout))
    return bad("--host-layout: '" + f.host_layout + "' is not one of layer_first, page_first");

  if (c.hugetlbfs_dir.empty() || c.hugetlbfs_dir[0] != '/')
    return bad("--hugetlbfs-dir: '" + c.hugetlbfs_dir + "' is not an absolute path");

  if (f.numa == "auto") {
    c.numa_node = kNumaAuto;
  } else if (f.numa == "none") {
    c.numa_node = -1;
  } else {
    int v = -1;
    const auto [p, ec] = std::from_chars(f.numa.data(), f.numa.data() + f.numa.size(), v);
    if (ec != std::errc() || p != f.numa.data() + f.numa.size() || v < 0 || v > 1023)
      return bad("--numa-node: '" + f.numa + "' is not auto, none or a node number in [0, 1023]");
    c.numa_node = v;
  }
  return {};
}

Status<ConfigErrc> resolve_session(RawFlags& f, DaemonConfig& c) {
  // FastDeploy 2.0/2.1 suffixed its IPCSignals with the engine's pid (--engine_pid); later
  // releases pass no pid and use the engine worker queue port.
  if (!f.engine_pid.empty()) c.fastdeploy.engine_worker_queue_port = f.engine_pid;
  const auto& fd_port = c.fastdeploy.engine_worker_queue_port;
  if (!fd_port.empty() && (fd_port.size() > 32 || !proto::valid_session_suffix(fd_port)))
    return bad(std::string(f.engine_pid.empty() ? "--engine_worker_queue_port" : "--engine_pid") + ": '" + fd_port +
               "' must be 1-32 characters of [A-Za-z0-9_.-]");
  if (f.suffix.empty() && !fd_port.empty()) f.suffix = fastdeploy_session_suffix(fd_port);
  if (f.suffix.empty())
    return bad("--session: required (or FastDeploy's --engine_worker_queue_port, which names the session "
               "fastdeploy.<port>)");
  c.session_suffix = f.suffix;
  if (!proto::valid_session_suffix(f.suffix))
    return bad("--session: '" + f.suffix + "' must be 1-64 characters of [A-Za-z0-9_.-]");
  // FastDeploy's transfer manager names its store namespace after the model directory.
  if (!c.fastdeploy.model_path.empty() && f.model_id_opt->count() == 0) {
    std::string path = c.fastdeploy.model_path;
    while (path.size() > 1 && path.back() == '/') path.pop_back();
    const auto slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? path : path.substr(slash + 1);
    if (dir.empty() || dir == "/")
      return bad("--model_path: '" + c.fastdeploy.model_path + "' names no model directory");
    // FastDeploy serves any directory name (a space, 70 characters): one a model id cannot hold
    // is encoded, a distinct id per distinct name.
    c.model_id = proto::name_of_text(dir, 64);
  }
  return {};
}

Status<ConfigErrc> resolve_runtime(const RawFlags& f, DaemonConfig& c) {
  if (!kvtd::valid_log_level(c.log_level))
    return bad("--log-level: '" + c.log_level + "' is not one of " + kLogLevelList);
  if (!(c.engine_timeout_s >= 0.001 && c.engine_timeout_s <= kMaxEngineTimeoutS))
    return bad("--engine-timeout: " + seconds(c.engine_timeout_s) + " must be in [0.001, 3600] seconds");
  if (!(c.engine_event_timeout_s == 0 || (c.engine_event_timeout_s >= 0.001 && c.engine_event_timeout_s <= 3600)))
    return bad("--engine-event-timeout: " + seconds(c.engine_event_timeout_s) + " must be 0 (none) or in [0.001, 3600] seconds");
  if (!(c.stuck_copy_timeout_s == 0 || (c.stuck_copy_timeout_s >= 0.1 && c.stuck_copy_timeout_s <= 3600)))
    return bad("--stuck-copy-timeout: " + seconds(c.stuck_copy_timeout_s) + " must be 0 (never) or in [0.1, 3600] seconds");
  if (!(c.attach_timeout_s == 0 || (c.attach_timeout_s >= 0.001 && c.attach_timeout_s <= kMaxAttachTimeoutS)))
    return bad("--attach-timeout: " + seconds(c.attach_timeout_s) +
               " must be 0 (wait forever) or in [0.001, 604800] seconds");
  if (!c.control_endpoint.empty() && c.control_endpoint.rfind("tcp://127.0.0.1:", 0) != 0 &&
      c.control_endpoint.rfind("tcp://localhost:", 0) != 0)
    return bad("--control-endpoint: '" + c.control_endpoint + "' must be tcp://127.0.0.1:<port> or tcp://localhost:<port>");
  if (!c.control_endpoint.empty() && c.control_secret_file.empty())
    return bad("--control-endpoint: needs --control-secret-file (any local user can reach a TCP port; the ipc "
               "socket in the runtime directory is private to this user)");
  if (f.metrics_port < 0 || f.metrics_port > 65535)
    return bad(fmt::format("--metrics-port: {} must be 0 (off) or a TCP port in [1, 65535]", f.metrics_port));
  c.metrics_port = static_cast<std::uint16_t>(f.metrics_port);
  if (!is_ipv4_address(c.metrics_address))
    return bad("--metrics-address: '" + c.metrics_address + "' is not an IPv4 address (e.g. 127.0.0.1 or 0.0.0.0)");
  if (!(c.log_summary_period_s == 0 || (c.log_summary_period_s >= 0.01 && c.log_summary_period_s <= 86400)))
    return bad("--log-summary-period: " + seconds(c.log_summary_period_s) + " must be 0 (none) or in [0.01, 86400] seconds");
  // The engine declares a f.rank dead after its f.rank timeout (3 s by default) without a heartbeat.
  if (!(c.heartbeat_period_s >= kMinHeartbeatPeriodS && c.heartbeat_period_s <= kMaxHeartbeatPeriodS))
    return bad("--heartbeat-period: " + seconds(c.heartbeat_period_s) +
               " must be in [0.001, 1] seconds; the engine counts a rank dead after 3 s of silence");

  if (proto::is_group_session(c.cache_groups)) {
    // Checked with the groups (resolve_groups) and what they cannot serve yet (resolve_group_limits).
  } else if (const auto why = proto::geometry_problem(c.geometry()); !why.empty()) {
    return bad("--key-cache-shape/--value-cache-shape/--num-layers/--num-host-blocks: " + why);
  }
  if (const auto why = c.object_slicing_problem(); !why.empty()) return bad(why);
  return {};
}

}  // namespace

Result<DaemonConfig, ConfigErrc> parse_daemon_flags(int argc, const char* const* argv) {
  DaemonConfig c;
  RawFlags f;
  CLI::App app{"kvtd - KV-cache transfer daemon, one process per GPU rank", "kvtd"};
  app.set_version_flag("--version", std::string("kvtd ") + kVersion);
  auto instance_config = instance_config_file(argc, argv);  // --config-dir with --instance
  if (!instance_config) return instance_config.error();
  if (const std::string file = instance_config->empty() ? scan_flag_value(argc, argv, "--config") : *instance_config;
      !file.empty())
    KVTD_TRY(check_config_file(file));
  app.set_config("--config", *instance_config, "Read flags from a TOML or INI file", !instance_config->empty());
  app.allow_config_extras(CLI::config_extras_mode::error);  // a typo in a config file is an error
  app.get_formatter()->column_width(40);
  declare_rank_flags(app, f);
  declare_runtime_flags(app, f, c);
  declare_storage_flags(app, f, c);
  declare_identity_flags(app, f);
  declare_kv_events_flags(app, c);
  declare_lifecycle_flags(app, c);
  declare_compat_flags(app, f, c);
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    std::ostringstream out;
    app.exit(e, out, out);
    return make_error(ConfigErrc::kHelp, out.str());
  } catch (const CLI::ParseError& e) {
    return make_error(ConfigErrc::kParse, std::string(e.what()) + " (run with --help for usage)");
  } catch (const std::exception& e) {  // CLI11 throws more than ParseError on odd input
    return make_error(ConfigErrc::kParse, std::string(e.what()) + " (run with --help for usage)");
  }
  for (auto* o : f.compat_opts)
    if (o->count() > 0) c.ignored_flags.push_back(o->get_name());
  KVTD_TRY(resolve_ranks(f, c));
  KVTD_TRY(resolve_cache(f, c));
  KVTD_TRY(resolve_identity(f, c));
  KVTD_TRY(resolve_devices(f, c));
  KVTD_TRY(resolve_session(f, c));
  KVTD_TRY(resolve_runtime(f, c));
  KVTD_TRY(resolve_storage(f, c));
  KVTD_TRY(resolve_group_limits(c));
  KVTD_TRY(resolve_lifecycle(c));
  KVTD_TRY(resolve_kv_events(c));
  return c;
}

}  // namespace kvtd::config
