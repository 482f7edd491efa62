// kvtd/ipc/populate.h - fault in a mapping up front.
//
// Shared-memory objects are sparse and each process maps them lazily, so the first touch of
// every 4 KiB page costs a fault (and, for a fresh object, a page allocation). Copies on the hot
// path must not pay that: mappings used for transfers are populated once when they are opened.
#pragma once

#include <cstddef>

namespace kvtd::ipc {

// Populates [addr, addr+bytes) for writing (MADV_POPULATE_WRITE, or touching each page on
// kernels before 5.14); the contents never change. Thread-safety: threads may populate disjoint
// ranges at once; on old kernels nothing else may write the range meanwhile (the touch is an
// atomic add of 0 to one byte per page).
void populate_for_write(void* addr, std::size_t bytes);

}  // namespace kvtd::ipc
