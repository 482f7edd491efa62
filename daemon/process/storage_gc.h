// `kvtd ctl storage gc` on one daemon: the store's garbage collection with what this deployment
// keeps (its model unless others are named, its layout, the weight version the operator names),
// the removed keys of this group told to routers (KV events), and the answer for the control
// socket.
#pragma once

#include <vector>

#include "kvtd/config/daemon_config.h"
#include "kvtd/control/control.h"

namespace kvtd::storage {
class ObjectStore;
}
namespace kvtd::events {
class KvEventPublisher;
}

namespace kvtd::daemon {

// Runs on the control thread for up to gc.max_seconds. `stores` empty: refused (no storage
// tier); Redis on a rank other than 0: skipped (rank 0 walks the shared store). A session of
// cache groups keeps every group's namespace, and each group's store walks (the first removes,
// the others bring their capacity accounting up to date). `kv_events` may be null.
control::Reply collect_storage(const config::DaemonConfig& cfg, const std::vector<storage::ObjectStore*>& stores,
                               events::KvEventPublisher* kv_events, const control::Request::StorageGc& gc);

}  // namespace kvtd::daemon
