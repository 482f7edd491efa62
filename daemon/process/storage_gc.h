// `kvtd ctl storage gc` on one daemon: the store's garbage collection with what this deployment
// keeps (its model unless others are named, its layout, the weight version the operator names),
// the removed keys of this group told to routers (KV events), and the answer for the control
// socket.
#pragma once

#include "kvtd/config/daemon_config.h"
#include "kvtd/control/control.h"

namespace kvtd::storage {
class ObjectStore;
}
namespace kvtd::events {
class KvEventPublisher;
}

namespace kvtd::daemon {

// Runs on the control thread for up to gc.max_seconds. `store` null: refused (no storage tier);
// Redis on a rank other than 0: skipped (rank 0 walks the shared store). `kv_events` may be null.
control::Reply collect_storage(const config::DaemonConfig& cfg, storage::ObjectStore* store,
                               events::KvEventPublisher* kv_events, const control::Request::StorageGc& gc);

}  // namespace kvtd::daemon
