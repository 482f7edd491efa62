// kvtd/config/daemon_config.h - the daemon's configuration: command-line flags (CLI11), an
// optional config file (--config, TOML or INI), and validation.
//
// Both kvtd's own flag names (--mp-num) and FastDeploy's cache-transfer names (--mp_num) are
// accepted, so an engine that launched the Python manager can launch kvtd instead.
//
// Thread-safety: parse_daemon_flags is reentrant. DaemonConfig is a plain value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtd/device_modes.h"
#include "kvtd/proto/expected.h"
#include "kvtd/proto/cache_groups.h"
#include "kvtd/proto/geometry.h"
#include "kvtd/proto/kv_identity.h"
#include "kvtd/proto/object_slices.h"

namespace kvtd::config {

enum class ConfigErrc {
  kHelp,          // --help or --version was asked for: message holds the text, exit 0
  kParse,         // unknown flag, missing value, unreadable config file
  kInvalidValue,  // a value failed validation; the message names the flag
};

// --numa-node auto: the node sysfs gives for the rank's GPU (none on the host backend).
inline constexpr int kNumaAuto = -2;

enum class DeviceBackendKind { kHost, kCuda };

// --verify-swaps: checksums of swapped blocks, computed where the device blocks are as they go
// out and again after they come back in; a mismatch fails the swap-in (status integrity).
enum class VerifySwaps {
  kOff,      // "off"
  kSampled,  // "sampled": host blocks whose id is a multiple of kVerifySampleEvery (default)
  kFull,     // "full": every block
};
inline constexpr std::int32_t kVerifySampleEvery = 8;
const char* verify_swaps_name(VerifySwaps v);
bool parse_verify_swaps(const std::string& text, VerifySwaps* out);

enum class StorageBackendKind { kNone, kFile, kRedis };
enum class WritePolicy {
  kNone,                   // no --write-policy: backups submitted with swaps are skipped
  kWriteThrough,           // every SWAP_TO_HOST with keys is backed up
  kWriteThroughSelective,  // only keys seen at least --write-threshold times
  kWriteBack,              // backed up when the engine evicts them from host (evict_backup)
};
enum class StorageFsync { kNone, kData, kFull };

struct StorageConfig {
  StorageBackendKind backend = StorageBackendKind::kNone;
  std::string path;                      // file: root directory
  std::vector<std::string> redis_endpoints;  // host:port
  std::string redis_password_file;
  std::string redis_password_env = "KVTD_REDIS_PASSWORD";
  double redis_timeout_s = 2.0;
  std::int64_t redis_ttl_s = 0;          // > 0: objects expire this long after their write
  double capacity_gib = 0;               // file: 0 = unlimited
  StorageFsync fsync = StorageFsync::kNone;
  // file: loads read with O_DIRECT (io_uring) into aligned buffers instead of through the page
  // cache (--storage-io direct); writes stay buffered.
  bool direct_reads = false;
  std::uint32_t io_threads = 0;          // 0: sized from the machine at start (storage_io_threads)
  std::uint64_t staging_mib = 64;
  // Backups (write-through, selective, write-back writes) waiting for the store: past this many
  // bytes agreed and not yet written, or this age since the engine submitted them, a backup is
  // skipped (status backup_skipped) instead of queueing behind a store slower than the engine.
  std::uint64_t backup_queue_mib = 256;
  std::uint32_t backup_max_age_ms = 2000;
  WritePolicy write_policy = WritePolicy::kNone;
  std::uint32_t write_threshold = 2;
  std::uint64_t weight_version = 0;      // deployment's weight label, part of every key
  // KV heads per stored object (--storage-object-heads; kvtd/proto/object_slices.h): 0 stores
  // each rank's slice as one object, readable at this TP size only; N > 0 stores objects of N
  // heads, readable by a deployment of any TP size whose heads per rank N divides.
  std::uint32_t object_heads = 0;
  // The model's KV heads (--storage-kv-heads), when fewer than ranks (each head replicated on
  // ranks / heads ranks); 0: heads per rank x ranks.
  std::uint32_t kv_heads = 0;
  // FastDeploy's RL key prefix ("RL-STEP12", from <--model_path>/version.yaml), part of every
  // key when set, so a weight update never loads KV of the old weights. Empty: not used.
  std::string key_prefix;
  // The model directory key_prefix comes from (--model_path): read again whenever the engine's
  // weight version changes (the engine bumps it at FastDeploy's sync points: a weight update,
  // update_weights, resume), as FastDeploy's transfer manager refreshes its prefix there.
  std::string key_prefix_source;
};

// What a FastDeploy launch line says beyond kvtd's own flags.
struct FastDeployLaunch {
  // Suffix of FastDeploy's IPCSignals (cache_ready_signal.<suffix>): --engine_worker_queue_port,
  // or FastDeploy 2.0/2.1's --engine_pid.
  std::string engine_worker_queue_port;
  std::string model_path;                // --model_path: the model id and version.yaml come from it
  // --create_cache_tensor (FastDeploy with a storage backend): when the engine registers no
  // tensors, the daemon allocates its rank's cache and publishes it by FastDeploy's names for
  // FastDeploy's worker to map, as FastDeploy's transfer manager does.
  bool create_cache_tensor = false;
};

// The session suffix a FastDeploy deployment uses when kvtd is launched with FastDeploy's flags
// and no --session: the adapter (python/kvtd/fastdeploy.py) creates the session by the same rule.
std::string fastdeploy_session_suffix(const std::string& engine_worker_queue_port);

// FastDeploy's file store root when --storage-path is absent: $FILE_BACKEND_STORAGE_DIR, else its
// default (fastdeploy/envs.py: FILE_BACKEND_STORAGE_DIR, "/tmp/fastdeploy").
// FastDeploy's RL key prefix of a model directory, as its cache transfer manager derives it: the
// `version` of <model_path>/version.yaml ("RL-STEP12-<timestamp>-<uuid>") cut to its first two
// dash-separated parts ("RL-STEP12"). No version.yaml: empty (FastDeploy then uses no prefix).
// A version.yaml without a `version` line, or one kvtd cannot read, is an error naming the file.
[[nodiscard]] Result<std::string, ConfigErrc> fastdeploy_key_prefix(const std::string& model_path);

inline constexpr const char* kFastDeployStorageDirEnv = "FILE_BACKEND_STORAGE_DIR";
inline constexpr const char* kFastDeployStorageDirDefault = "/tmp/fastdeploy";

// KV events for KV-aware routers (--kv-events-*): rank 0 publishes what the storage tier holds.
struct KvEventsConfig {
  std::string endpoint;          // empty: no events
  std::string format = "map";    // map (vLLM's current layout) | array (vLLM <= 0.10)
  std::string topic;             // the first ZeroMQ frame of every batch
  std::string medium;            // empty: STORAGE (vLLM's MEDIUM_STORAGE)
  std::string locality;          // empty: LOCAL for the file store, REMOTE for Redis; "none": left out
};

struct DaemonConfig {
  std::uint32_t rank = 0;
  std::uint32_t mp_num = 1;
  std::uint32_t data_parallel_id = 0;  // --local_data_parallel_id: part of the log file name
  std::string group;                   // --instance <group>-<rank>: part of the log file name; "" alone
  std::int32_t device_id = 0;
  std::uint32_t num_layers = 1;        // the model's layers (--num-layers); geometry adds the extra ones
  std::uint32_t num_extra_layers = 0;  // MTP / speculative layers after them
  std::int64_t extra_device_blocks = 0;  // device blocks of each extra layer
  std::uint32_t scale_bytes = 2;       // block_wise_fp8 scale element bytes (--default-dtype)
  std::uint32_t num_host_blocks = 0;
  std::int64_t key_cache_shape[4] = {0, 0, 0, 0};
  std::int64_t value_cache_shape[4] = {0, 0, 0, 0};  // all zero: no value cache
  proto::CacheDtype cache_dtype = proto::CacheDtype::kBFloat16;
  // --cache-group (one per group, kvtd/proto/group_spec.h): the cache as groups instead of the
  // single shape above (num_groups 0: the single shape). Swaps only, so far: no storage backend.
  proto::CacheGroups cache_groups{};
  // --kv-layout, --kv-dtype, --pp-rank/--pp-size, --cp-rank/--cp-size: what the KV is beyond its
  // shape (kvtd/proto/kv_identity.h). Part of the storage namespace; the session must declare the same.
  proto::KvIdentity kv_identity{};
  std::string session_suffix;
  DeviceBackendKind device_backend = DeviceBackendKind::kHost;
  daemon::ScatterMode scatter_mode = daemon::ScatterMode::kBatch;
  bool scatter_mode_given = false;     // --scatter-mode was on the command line
  VerifySwaps verify_swaps = VerifySwaps::kSampled;
  std::uint32_t copy_batch_max = 4096;  // copies per cudaMemcpyBatchAsync call (--copy-batch-max)
  // A copy lane's poll window around its copy's end (--copy-wait-spin-us); 0: the driver's wait.
  // 0 by default: on the H100 (2026-11-28) a 200 us window cost 4-12x at 16 blocks a task.
  std::uint32_t copy_wait_spin_us = 0;
  daemon::HostLayout host_layout = daemon::HostLayout::kLayerFirst;
  bool host_pool_hugepages = false;    // the host pool in huge pages: a file in hugetlbfs_dir
  std::string hugetlbfs_dir = "/dev/hugepages";
  std::uint32_t host_pool_pin_threads = 4;  // background cudaHostRegister threads (--host-pool-pin-threads)
  std::uint32_t host_pool_pin_first_mib = 1024;  // pinned before serving (--host-pool-pin-first-mib)
  int numa_node = kNumaAuto;           // host pool and copy threads; kNumaAuto: the GPU's, -1: none
  std::string log_dir;                 // empty: log to stderr only
  std::string log_level = "info";
  double log_summary_period_s = 60;
  std::uint16_t metrics_port = 0;      // Prometheus and health probes on metrics_address:<port>; 0 = off
  std::string metrics_address = "127.0.0.1";
  std::string control_endpoint;        // extra control socket, tcp://127.0.0.1:<port>; empty = ipc only
  std::string control_secret_file;     // the TCP control endpoint's shared secret (required with it)    // info summary of the work done, while busy; 0 = none
  double engine_timeout_s = 5.0;       // engine heartbeat age after which we detach
  // A swap waits this long at most for its engine event while the engine lives (0: no bound but
  // the engine's liveness and the task's deadline): engine_event_not_fired past it.
  double engine_event_timeout_s = 60.0;
  // A device copy running this long: the daemon says it is stuck (log, kvtd_copy_running_seconds,
  // /readyz false); at twice this it exits 8 for systemd to restart it (0: never).
  double stuck_copy_timeout_s = 60.0;
  double attach_timeout_s = 0.0;       // 0: wait for the session forever
  double heartbeat_period_s = 0.1;
  std::string model_id = "default";
  StorageConfig storage;
  KvEventsConfig kv_events;
  FastDeployLaunch fastdeploy;
  std::vector<std::string> ignored_flags;  // FastDeploy flags given that kvtd accepts and ignores

  // The single-shape geometry, or with --cache-group the groups' envelope (proto::envelope_of).
  proto::CacheGeometry geometry() const;
  // How this rank cuts its blocks into stored objects (kvtd/proto/object_slices.h): "" and *out
  // filled, or the problem naming the flag. Replicated as kv_layout() says.
  std::string object_slicing(proto::ObjectSlicing* out) const;
  // The layout this daemon acts on: --kv-layout, else FastDeploy's reading of its launch line (no
  // value cache: an MLA latent, replicated). A session of cache groups: kUndeclared (per group).
  proto::KvLayout kv_layout() const;
  std::string object_slicing_problem() const {
    proto::ObjectSlicing unused;
    return object_slicing(&unused);
  }
  // The durations in nanoseconds (validated ranges keep these far from overflow).
  std::int64_t engine_timeout_ns() const { return static_cast<std::int64_t>(engine_timeout_s * 1e9); }
  std::int64_t attach_timeout_ns() const { return static_cast<std::int64_t>(attach_timeout_s * 1e9); }
  std::int64_t heartbeat_period_ns() const { return static_cast<std::int64_t>(heartbeat_period_s * 1e9); }
};

// Ranges of the duration flags, in seconds.
inline constexpr double kMaxEngineTimeoutS = 3600;
inline constexpr double kMaxAttachTimeoutS = 7 * 86400;
inline constexpr double kMinHeartbeatPeriodS = 0.001;
inline constexpr double kMaxHeartbeatPeriodS = 1.0;
inline constexpr std::int64_t kMaxDeviceId = 1023;

// Parses argv (argv[0] is the program name). Errors carry the text to print. A config file
// (--config) with an unknown key or a line that is not `key = value` is an error naming it.
[[nodiscard]] Result<DaemonConfig, ConfigErrc> parse_daemon_flags(int argc, const char* const* argv);

// Parses "a,b,c,d" (or a 3-D "a,b,c", returned with d = 1) into four positive integers.
[[nodiscard]] Result<std::vector<std::int64_t>, ConfigErrc> parse_shape(const std::string& text,
                                                                       const std::string& flag);

}  // namespace kvtd::config
