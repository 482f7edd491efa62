// start_up.h (daemon-internal) - what the daemon opens once, before its first session, and keeps
// for every session after: the device backend, the NUMA node, the storage tier, the metrics
// registry and server, the control socket.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "kvtd/config/daemon_config.h"
#include "kvtd/control/control.h"
#include "kvtd/daemon/control_handler.h"
#include "health.h"
#include "stuck_copy_watch.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/events/kv_events.h"
#include "kvtd/metrics/http_server.h"
#include "kvtd/metrics/registry.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::daemon {

// Declared in dependency order: each member may be used by the ones after it, and members are
// destroyed in reverse (the control server and the metrics server stop before what they read).
// Not copyable or movable (the servers hold references into it).
struct Services {
  std::unique_ptr<DeviceBackend> backend;
  std::unique_ptr<StuckCopyWatch> stuck_copy_watch;  // after the backend: destroyed before it
  int numa_node = -1;                // where the host pool and copy threads live (-1: anywhere)
  proto::CacheGeometry geometry{};   // from the flags (with --cache-group: the groups' envelope)
  proto::CacheGroups groups{};       // from --cache-group (num_groups 0: a single-shape geometry)
  proto::ObjectSlicing slicing;      // how this rank's blocks are stored (the flags checked it)
  // Rank 0 with --kv-events-endpoint (else null). Before the store: its eviction hook uses it.
  std::unique_ptr<events::KvEventPublisher> kv_events;
  std::unique_ptr<storage::ObjectStore> store;  // null: --storage-backend none; with groups, group 0's
  // With --cache-group, groups 1.. (each group's objects are a namespace of their own,
  // group_fingerprint, with their own size); the probe and the metrics ask `store`.
  std::vector<std::unique_ptr<storage::ObjectStore>> group_stores;
  // The store of cache group `g` (0: `store`).
  storage::ObjectStore* store_of_group(std::uint32_t g) const {
    return g == 0 ? store.get() : group_stores.at(g - 1).get();
  }
  // Every namespace's store of this rank, `store` first (empty without a store).
  std::vector<storage::ObjectStore*> stores() const {
    std::vector<storage::ObjectStore*> out;
    if (store) out.push_back(store.get());
    for (const auto& g : group_stores) out.push_back(g.get());
    return out;
  }
  std::unique_ptr<storage::ObjectStore> probe_store;  // Redis: the probe's own connections; else null
  std::string store_name;
  metrics::MetricsRegistry registry;  // counters survive sessions
  // Declared (so destroyed) in the order the servers read them: the servers go first.
  ControlState control_state;
  std::unique_ptr<StoreProbe> store_probe;  // null without a store
  std::unique_ptr<metrics::MetricsServer> metrics_server;
  std::unique_ptr<control::ControlServer> control;  // null when another daemon of the rank has it
};

// Opens every service in `s` from the flags, logging what it opened. Returns the exit code when
// the daemon cannot start (the reason logged), nullopt when it can.
std::optional<int> start_up(const config::DaemonConfig& cfg, std::atomic<bool>& stop, Services& s);

}  // namespace kvtd::daemon
