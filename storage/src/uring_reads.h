// Internal: whole-file O_DIRECT reads with io_uring (Debian's liburing), several in flight on one
// ring per calling thread. The POSIX FileSystem's read_direct is this.
#pragma once

#include <span>

#include "kvtd/storage/file_system.h"

namespace kvtd::storage::detail {

// Up to this many reads in flight per calling thread.
inline constexpr unsigned kUringDepth = 16;

// Opens each path with O_DIRECT and reads it from offset 0 into its buffer; per read, `error`
// (an open or read failure: EINVAL where the file system refuses O_DIRECT) and `bytes`. Returns
// 0, or an errno when this thread's ring could not be made (then nothing was read).
int read_direct_with_uring(std::span<DirectRead> reads);

}  // namespace kvtd::storage::detail
