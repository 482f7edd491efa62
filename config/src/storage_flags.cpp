// The storage tier's flags: declared, then checked and turned into DaemonConfig::storage, each
// error naming its flag.
#include <cstdlib>
#include <fmt/format.h>
#include <sstream>

#include "flag_groups.h"
#include "kvtd/config/daemon_config.h"
#include "kvtd/proto/names.h"
#include "raw_flags.h"

namespace kvtd::config {

void declare_storage_flags(CLI::App& app, RawFlags& f, DaemonConfig& c) {
  auto& st = c.storage;
  app.add_option("--storage-backend,--kvcache-storage-backend,--kvcache_storage_backend", f.storage_backend,
                 "Storage tier: none | file | redis");
  app.add_option("--storage-path", st.path, "file: root directory of the store");
  app.add_option("--redis-endpoints", f.redis_endpoints, "redis: host:port[,host:port...] (Cluster auto-detected)");
  app.add_option("--redis-password-file", st.redis_password_file, "redis: file whose first line is the password");
  app.add_option("--redis-password-env", st.redis_password_env, "redis: environment variable holding the password");
  app.add_option("--redis-timeout", st.redis_timeout_s, "redis: connect and reply deadline in seconds");
  app.add_option("--storage-capacity-gib", st.capacity_gib, "file: capacity in GiB, LRU eviction (0 = unlimited)");
  app.add_option("--storage-fsync", f.fsync, "file: none | data | full");
  app.add_option("--storage-io", f.storage_io,
                 "file: how loads read objects: buffered (page cache, default) | direct (O_DIRECT with io_uring)");
  f.io_threads_opt = app.add_option("--storage-io-threads", st.io_threads,
                 "Storage worker threads (never the swap lanes); default: half the CPUs, 2 to 8, within the staging");
  app.add_option("--storage-staging-mib", st.staging_mib, "Pinned staging for storage tasks, MiB (bounds RSS)");
  app.add_option("--storage-backup-queue-mib", st.backup_queue_mib,
                 "Backups waiting for the store beyond this many MiB are skipped (backup_skipped)");
  app.add_option("--storage-backup-max-age-ms", st.backup_max_age_ms,
                 "A backup not started this many ms after its submit is skipped (backup_skipped)");
  app.add_option("--write-policy,--write_policy", f.write_policy,
                 "Backups of swapped-out blocks: write_through | write_through_selective | write_back");
  app.add_option("--write-threshold", st.write_threshold, "write_through_selective: times a key is seen before backup");
  app.add_option("--weight-version", st.weight_version, "Weight version label of this deployment (namespaces keys)");
  app.add_option("--storage-object-heads", st.object_heads,
                 "KV heads per stored object: deployments of any TP size whose heads per rank it divides share "
                 "stored KV (0 = one object per rank slice, this TP size only)");
  app.add_option("--storage-kv-heads", st.kv_heads,
                 "The model's KV heads when fewer than the ranks (heads replicated across ranks); 0 = heads per "
                 "rank x ranks");
}

Status<ConfigErrc> resolve_storage(const RawFlags& f, DaemonConfig& c) {
  auto& st = c.storage;
  const auto& fd_port = c.fastdeploy.engine_worker_queue_port;
  if (f.storage_backend == "none") st.backend = StorageBackendKind::kNone;
  else if (f.storage_backend == "file") st.backend = StorageBackendKind::kFile;
  else if (f.storage_backend == "redis") st.backend = StorageBackendKind::kRedis;
  else
    return bad("--storage-backend: '" + f.storage_backend + "' is not built into this kvtd (built: none, file, redis)");
  // FastDeploy passes "--write_policy None" when its cache config has none.
  if (f.write_policy.empty() || f.write_policy == "none" || f.write_policy == "None") st.write_policy = WritePolicy::kNone;
  else if (f.write_policy == "write_through") st.write_policy = WritePolicy::kWriteThrough;
  else if (f.write_policy == "write_through_selective") st.write_policy = WritePolicy::kWriteThroughSelective;
  else if (f.write_policy == "write_back") st.write_policy = WritePolicy::kWriteBack;
  else return bad("--write-policy: '" + f.write_policy + "' is not one of write_through, write_through_selective, write_back");
  if (f.fsync == "none") st.fsync = StorageFsync::kNone;
  else if (f.fsync == "data") st.fsync = StorageFsync::kData;
  else if (f.fsync == "full") st.fsync = StorageFsync::kFull;
  else return bad("--storage-fsync: '" + f.fsync + "' is not one of none, data, full");
  if (f.storage_io == "direct") st.direct_reads = true;
  else if (f.storage_io != "buffered")
    return bad("--storage-io: '" + f.storage_io + "' is not buffered or direct");
  if (st.direct_reads && st.backend != StorageBackendKind::kFile)
    return bad("--storage-io direct: only the file store reads files (--storage-backend file)");
  if (st.backend == StorageBackendKind::kFile && st.path.empty() && !fd_port.empty()) {
    const char* env = std::getenv(kFastDeployStorageDirEnv);
    st.path = env != nullptr && *env != '\0' ? env : kFastDeployStorageDirDefault;
  }
  if (st.backend == StorageBackendKind::kFile && st.path.empty())
    return bad("--storage-path: required with --storage-backend file (the store's root directory)");
  if (!f.redis_endpoints.empty()) {
    std::stringstream in(f.redis_endpoints);
    for (std::string ep; std::getline(in, ep, ',');) {
      const auto colon = ep.rfind(':');
      const std::string port = colon == std::string::npos ? "" : ep.substr(colon + 1);
      const bool port_ok = !port.empty() && port.size() <= 5 &&
                           port.find_first_not_of("0123456789") == std::string::npos && std::stoi(port) > 0 &&
                           std::stoi(port) < 65536;
      if (colon == 0 || !port_ok) return bad("--redis-endpoints: '" + ep + "' is not host:port");
      st.redis_endpoints.push_back(ep);
    }
  }
  if (st.backend == StorageBackendKind::kRedis && st.redis_endpoints.empty())
    return bad("--redis-endpoints: required with --storage-backend redis");
  if (!(st.redis_timeout_s >= 0.001 && st.redis_timeout_s <= 600))
    return bad("--redis-timeout: " + seconds(st.redis_timeout_s) + " must be in [0.001, 600] seconds");
  if (!(st.capacity_gib >= 0 && st.capacity_gib <= 1 << 20))
    return bad("--storage-capacity-gib: " + seconds(st.capacity_gib) + " must be in [0, 1048576]");
  if (st.io_threads > 64 || (st.io_threads == 0 && f.io_threads_opt->count() != 0))
    return bad(fmt::format("--storage-io-threads: {} must be in [1, 64]", st.io_threads));
  if (st.staging_mib < 1 || st.staging_mib > 65536)
    return bad(fmt::format("--storage-staging-mib: {} must be in [1, 65536]", st.staging_mib));
  if (st.backup_queue_mib < 1 || st.backup_queue_mib > (1u << 20))
    return bad(fmt::format("--storage-backup-queue-mib: {} must be in [1, 1048576]", st.backup_queue_mib));
  if (st.backup_max_age_ms < 1 || st.backup_max_age_ms > 3'600'000)
    return bad(fmt::format("--storage-backup-max-age-ms: {} must be in [1, 3600000]", st.backup_max_age_ms));
  if (st.write_threshold < 1) return bad("--write-threshold: must be at least 1");
  if (st.object_heads > 4096)
    return bad(fmt::format("--storage-object-heads: {} must be in [0, 4096]", st.object_heads));
  if (st.kv_heads > 4096) return bad(fmt::format("--storage-kv-heads: {} must be in [0, 4096]", st.kv_heads));
  // Every deployment that shares a store must say which model its KV belongs to: two fine-tunes of
  // one shape under the default namespace would load each other's KV.
  if (st.backend != StorageBackendKind::kNone && f.model_id_opt->count() == 0 && c.fastdeploy.model_path.empty())
    return bad("--model-id: required with a storage backend (or FastDeploy's --model_path): deployments that share "
               "a store under one id load each other's KV");
  if (st.backend != StorageBackendKind::kNone && !c.fastdeploy.model_path.empty()) {
    KVTD_ASSIGN_OR_RETURN(st.key_prefix, fastdeploy_key_prefix(c.fastdeploy.model_path));
    st.key_prefix_source = c.fastdeploy.model_path;
  }
  return {};
}

}  // namespace kvtd::config
