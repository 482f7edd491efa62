#include "storage_gc.h"

#include <algorithm>
#include <span>
#include <unordered_set>
#include <nlohmann/json.hpp>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/events/kv_events.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/storage/object_name.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::daemon {

namespace {

// Whether rank 0's first object of `key` at the kept weight version is in the store (rank 0
// writes every layout, replicated MLA included; by head, its first object is head 0's).
// "Unknown" counts as stored: no removal is announced.
bool still_stored(storage::ObjectStore& store, const config::DaemonConfig& cfg, const proto::ObjectSlicing& slicing,
                  const std::string& key, std::uint64_t keep_wv) {
  const std::string name =
      storage::StoredName{key, cfg.storage.key_prefix, cfg.storage.weight_version, keep_wv, 0, slicing.by_head}
          .encode();
  auto n = store.exists(std::span<const std::string>(&name, 1));
  return !n.ok() || *n == 1;
}

// `request` over each of `stores` (a session of cache groups: a store per group's namespace).
// The first walk removes; the others bring their stores' capacity accounting up to date with what
// it removed from their namespaces (they find nothing more), so their counts add up.
Result<storage::GcReport, storage::StorageErrc> collect_every(const std::vector<storage::ObjectStore*>& stores,
                                                              const storage::GcRequest& request) {
  auto report = stores.front()->collect(request);
  for (std::size_t i = 1; report.ok() && i < stores.size() && !request.dry_run; ++i) {
    KVTD_ASSIGN_OR_RETURN(const auto more, stores[i]->collect(request));
    report->removed += more.removed;
    report->removed_bytes += more.removed_bytes;
    report->failed += more.failed;
    report->complete = report->complete && more.complete;
  }
  return report;
}

}  // namespace

control::Reply collect_storage(const config::DaemonConfig& cfg, const std::vector<storage::ObjectStore*>& stores,
                               events::KvEventPublisher* kv_events, const control::Request::StorageGc& gc) {
  control::Reply reply;
  storage::ObjectStore* const store = stores.empty() ? nullptr : stores.front();
  if (store == nullptr) {
    reply.ok = false;
    reply.error = "no storage tier on this rank (--storage-backend none): nothing to collect";
    return reply;
  }
  if (cfg.storage.backend == config::StorageBackendKind::kRedis && cfg.rank != 0) {
    reply.result_json = nlohmann::json{{"skipped", "rank 0 collects the shared Redis store"}}.dump();
    return reply;
  }
  storage::GcRequest request;
  request.keep_models = gc.keep_models;
  proto::ObjectSlicing slicing;
  if (auto why = cfg.object_slicing(&slicing); !why.empty()) {  // checked with the flags already
    reply.ok = false;
    reply.error = why;
    return reply;
  }
  if (proto::is_group_session(cfg.cache_groups)) {  // every group's namespace is this deployment's
    for (std::uint32_t g = 0; g < cfg.cache_groups.num_groups; ++g)
      request.keep_fingerprints.push_back(group_fingerprint(cfg.cache_groups, g, cfg.kv_identity));
  } else {
    request.keep_fingerprints = {layout_fingerprint(cfg.geometry(), slicing, cfg.kv_identity)};
  }
  request.dry_run = gc.dry_run;
  request.deadline_ns = ipc::monotonic_now_ns() + static_cast<std::int64_t>(gc.max_seconds * 1e9);
  const std::uint64_t config_wv = cfg.storage.weight_version;
  const std::uint64_t keep_wv = gc.keep_weight_version;
  // Engine keys of this deployment's objects the walk kept: a key whose old version went while
  // the kept version stays is still stored, and a router must not hear that it was removed.
  std::unordered_set<std::string> kept_keys;
  const bool tell = kv_events != nullptr;
  request.keep_name = [config_wv, keep_wv, tell, &kept_keys, &cfg](const std::string& name) {
    const auto parsed = storage::StoredName::parse(name);
    const bool keep = !parsed || (parsed->config_weight_version == config_wv && parsed->task_weight_version == keep_wv);
    if (keep && tell)
      if (auto ours = storage::StoredName::parse(name, cfg.storage.key_prefix)) kept_keys.insert(std::move(ours->key));
    return keep;
  };
  std::vector<std::string> removed_keys;  // this group's, for the routers
  if (tell)
    request.on_removed = [&](const std::string& model, const std::string& name) {
      if (model != cfg.model_id) return;
      if (auto ours = storage::StoredName::parse(name, cfg.storage.key_prefix))
        removed_keys.push_back(std::move(ours->key));
    };
  auto report = collect_every(stores, request);
  if (!report.ok()) {
    reply.ok = false;
    reply.error = report.error().message;
    return reply;
  }
  if (tell) {
    // Every rank's slice of a block has its own object: one event per key is enough.
    std::sort(removed_keys.begin(), removed_keys.end());
    removed_keys.erase(std::unique(removed_keys.begin(), removed_keys.end()), removed_keys.end());
    std::erase_if(removed_keys, [&](const std::string& key) {
      if (kept_keys.count(key) != 0) return true;
      // A walk cut short by its time limit may not have reached the kept version: ask the store.
      return !report->complete && still_stored(*store, cfg, slicing, key, keep_wv);
    });
    if (!removed_keys.empty()) kv_events->removed(std::move(removed_keys));
  }
  const auto& r = *report;
  KVTD_INFO("storage gc (keep weight version {}{}): {} {} objects ({} bytes) of {} examined, {} kept, {} failed, {} "
            "not kvtd's (left alone){}",
            keep_wv, gc.keep_models.empty() ? "" : ", named models only", gc.dry_run ? "would remove" : "removed",
            r.removed, r.removed_bytes, r.examined, r.kept, r.failed, r.foreign,
            r.complete ? "" : "; stopped at its time limit");
  reply.result_json = nlohmann::json{{"examined", r.examined}, {"removed", r.removed},
                                     {"removed_bytes", r.removed_bytes}, {"kept", r.kept},
                                     {"failed", r.failed},     {"foreign", r.foreign},
                                     {"complete", r.complete},
                                     {"dry_run", gc.dry_run}}
                          .dump();
  return reply;
}

}  // namespace kvtd::daemon
