// The names of the session's error codes (kvtd/ipc/errors.h).
#include "kvtd/ipc/errors.h"

namespace kvtd::ipc {

const char* ipc_errc_name(IpcErrc e) {
  switch (e) {
    case IpcErrc::kInvalidArgument: return "invalid_argument";
    case IpcErrc::kNotFound: return "not_found";
    case IpcErrc::kPermission: return "permission";
    case IpcErrc::kBadMagic: return "bad_magic";
    case IpcErrc::kBadVersion: return "bad_version";
    case IpcErrc::kGeometryMismatch: return "geometry_mismatch";
    case IpcErrc::kInUse: return "in_use";
    case IpcErrc::kTimeout: return "timeout";
    case IpcErrc::kRingFull: return "ring_full";
    case IpcErrc::kTooLarge: return "too_large";
    case IpcErrc::kTooManyInFlight: return "too_many_in_flight";
    case IpcErrc::kNotReady: return "not_ready";
    case IpcErrc::kUnknownTask: return "unknown_task";
    case IpcErrc::kTaskFailed: return "task_failed";
    case IpcErrc::kClosed: return "closed";
    case IpcErrc::kNoSpace: return "no_space";
    case IpcErrc::kCorrupt: return "corrupt";
    case IpcErrc::kSystem: return "system";
    case IpcErrc::kCacheCleared: return "cache_cleared";
    case IpcErrc::kWrongProcess: return "wrong_process";
  }
  return "unknown";
}

}  // namespace kvtd::ipc
