// status_of.h - the one place a store's or the device's failure becomes a task's status, chosen
// by what the engine should do next (the table is in status_of.cpp, pinned by status_of_test):
//   kStorageUnavailable  the store could not be reached, or failed a read: the KV may well be
//                        stored, so retry later or recompute; never reported as "not stored";
//   kStorageError        the store refused a write (ENOSPC, a server error, a bad request):
//                        nothing is torn, the blocks are still where they were;
//   kOk                  not a failure: a read's miss or corrupt object is a block not loaded,
//                        which the engine recomputes;
//   kEngineEventNotFired the engine's event never completed: nothing was copied;
//   kDeviceError         the copy failed (a lost context also ends the daemon for a restart).
// Pure functions: no state, any thread.
#pragma once

#include "kvtd/daemon/device_backend.h"
#include "kvtd/proto/task.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::daemon {

// kLookup: exists(), before any agreement (a failed lookup is never taken for "not stored").
enum class StoreCall { kLookup, kRead, kWrite };

// A whole store call that failed.
proto::TaskStatus status_of(storage::StorageErrc e, StoreCall call);
// One object's result within a call that ran.
proto::TaskStatus status_of(storage::ObjectResult r, StoreCall call);
// A device operation that failed.
proto::TaskStatus status_of(DeviceErrc e);

}  // namespace kvtd::daemon
