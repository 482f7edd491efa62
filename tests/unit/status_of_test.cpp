// Every store and device failure against the task status the engine receives (storage/status_of.h):
// one table, so the mapping is written once and a change to it is a change to this test.
#include <gtest/gtest.h>

#include <tuple>

#include "kvtd/daemon/status_of.h"

namespace kvtd::daemon {
namespace {

using proto::TaskStatus;
using storage::ObjectResult;
using storage::StorageErrc;

TEST(StatusOf, AWholeStoreCallThatFailed) {
  const std::tuple<StorageErrc, StoreCall, TaskStatus> table[] = {
      {StorageErrc::kUnavailable, StoreCall::kRead, TaskStatus::kStorageUnavailable},
      {StorageErrc::kUnavailable, StoreCall::kWrite, TaskStatus::kStorageUnavailable},
      // A read that failed is never "not stored": the object may be there.
      {StorageErrc::kIo, StoreCall::kRead, TaskStatus::kStorageUnavailable},
      {StorageErrc::kProtocol, StoreCall::kRead, TaskStatus::kStorageUnavailable},
      {StorageErrc::kIo, StoreCall::kWrite, TaskStatus::kStorageError},
      {StorageErrc::kProtocol, StoreCall::kWrite, TaskStatus::kStorageError},
      {StorageErrc::kInvalidArgument, StoreCall::kRead, TaskStatus::kStorageError},
      {StorageErrc::kInvalidArgument, StoreCall::kWrite, TaskStatus::kStorageError},
      // A lookup (exists) the store could not answer: unreachable is worth a retry, anything
      // else is the store's error.
      {StorageErrc::kUnavailable, StoreCall::kLookup, TaskStatus::kStorageUnavailable},
      {StorageErrc::kIo, StoreCall::kLookup, TaskStatus::kStorageError},
      {StorageErrc::kProtocol, StoreCall::kLookup, TaskStatus::kStorageError},
      {StorageErrc::kInvalidArgument, StoreCall::kLookup, TaskStatus::kStorageError},
  };
  for (const auto& [e, call, want] : table)
    EXPECT_EQ(status_of(e, call), want) << static_cast<int>(e) << (call == StoreCall::kRead ? " read" : " write");
}

TEST(StatusOf, OneObjectsResult) {
  const std::tuple<ObjectResult, StoreCall, TaskStatus> table[] = {
      {ObjectResult::kOk, StoreCall::kRead, TaskStatus::kOk},
      {ObjectResult::kOk, StoreCall::kWrite, TaskStatus::kOk},
      {ObjectResult::kMissing, StoreCall::kRead, TaskStatus::kOk},  // a miss: recomputed
      {ObjectResult::kCorrupt, StoreCall::kRead, TaskStatus::kOk},  // verified and refused: a miss
      {ObjectResult::kFailed, StoreCall::kRead, TaskStatus::kStorageUnavailable},
      {ObjectResult::kFailed, StoreCall::kWrite, TaskStatus::kStorageError},
      {ObjectResult::kMissing, StoreCall::kWrite, TaskStatus::kStorageError},
      {ObjectResult::kCorrupt, StoreCall::kWrite, TaskStatus::kStorageError},
  };
  for (const auto& [r, call, want] : table)
    EXPECT_EQ(status_of(r, call), want) << storage::object_result_name(r) << (call == StoreCall::kRead ? " read" : " write");
}

TEST(StatusOf, ADeviceFailure) {
  const std::tuple<DeviceErrc, TaskStatus> table[] = {
      {DeviceErrc::kEventNotFired, TaskStatus::kEngineEventNotFired},
      {DeviceErrc::kCopyFailed, TaskStatus::kDeviceError},
      {DeviceErrc::kContextLost, TaskStatus::kDeviceError},  // and the daemon exits for a restart
      {DeviceErrc::kOpenFailed, TaskStatus::kDeviceError},
      {DeviceErrc::kAllocFailed, TaskStatus::kDeviceError},
      {DeviceErrc::kUnavailable, TaskStatus::kDeviceError},
  };
  for (const auto& [e, want] : table) EXPECT_EQ(status_of(e), want) << static_cast<int>(e);
}

}  // namespace
}  // namespace kvtd::daemon
