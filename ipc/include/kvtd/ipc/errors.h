// kvtd/ipc/errors.h - error codes of the ipc module (session, rings, client, endpoint).
#pragma once

namespace kvtd::ipc {

enum class IpcErrc {
  kInvalidArgument,   // a caller-supplied value is out of range (message names it)
  kNotFound,          // the session segment does not exist (yet)
  kPermission,        // segment owned by another user, or mode too open
  kBadMagic,          // the segment is not a kvtd session
  kBadVersion,        // layout version differs from this build's
  kGeometryMismatch,  // the session's cache geometry differs from the daemon's flags
  kInUse,             // a live engine already owns a session of that name
  kTimeout,           // a bounded wait passed its deadline
  kRingFull,          // the task ring had no room before the deadline
  kTooLarge,          // a task does not fit in the ring at all
  kTooManyInFlight,   // every completion slot is taken by unfinished tasks
  kNotReady,          // a rank is not attached, so the task cannot be delivered
  kUnknownTask,       // no such task id pending
  kTaskFailed,        // the task completed with a failure (message names the rank and cause)
  kClosed,            // the session was closed or the engine is gone
  kNoSpace,           // the file system backing shared memory is full (message names size and free space)
  kCorrupt,           // shared memory holds values that break its invariants (message names the field)
  kSystem,            // an OS call failed (message has errno text)
  kCacheCleared,      // the KV cache is cleared for a weight update: restore_caches() first
  kWrongProcess,      // the session was created by another process (e.g. used in a forked child)
};

const char* ipc_errc_name(IpcErrc e);

}  // namespace kvtd::ipc
