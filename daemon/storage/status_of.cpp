#include "kvtd/daemon/status_of.h"

namespace kvtd::daemon {

using proto::TaskStatus;

TaskStatus status_of(storage::StorageErrc e, StoreCall call) {
  switch (e) {
    case storage::StorageErrc::kUnavailable: return TaskStatus::kStorageUnavailable;
    case storage::StorageErrc::kIo:
    case storage::StorageErrc::kProtocol:
      // A read that failed may still have the object stored: the engine must not take it for a miss.
      return call == StoreCall::kRead ? TaskStatus::kStorageUnavailable : TaskStatus::kStorageError;
    case storage::StorageErrc::kInvalidArgument: return TaskStatus::kStorageError;
  }
  return TaskStatus::kStorageError;
}

TaskStatus status_of(storage::ObjectResult r, StoreCall call) {
  switch (r) {
    case storage::ObjectResult::kOk: return TaskStatus::kOk;
    case storage::ObjectResult::kMissing:
    case storage::ObjectResult::kCorrupt:
      return call == StoreCall::kRead ? TaskStatus::kOk : TaskStatus::kStorageError;  // a miss
    case storage::ObjectResult::kFailed:
      return call == StoreCall::kRead ? TaskStatus::kStorageUnavailable : TaskStatus::kStorageError;
  }
  return TaskStatus::kStorageError;
}

TaskStatus status_of(DeviceErrc e) {
  return e == DeviceErrc::kEventNotFired ? TaskStatus::kEngineEventNotFired : TaskStatus::kDeviceError;
}

}  // namespace kvtd::daemon
