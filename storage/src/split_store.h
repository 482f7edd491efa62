// Internal: one ObjectStore over two of the same kind, reads (exists and every get) on one and
// writes (every put, remove) on the other. A store that serialises commands on one connection
// per server (Redis: a pipeline is one request-reply stream) would otherwise make a load wait
// behind a slow or paused write; with two, loads keep their own connections.
//
// Ownership: owns both. Thread-safety: as the two stores are (both are fully thread-safe).
#pragma once

#include <memory>

#include "kvtd/storage/object_store.h"

namespace kvtd::storage::detail {

std::unique_ptr<ObjectStore> split_reads_and_writes(std::unique_ptr<ObjectStore> reads,
                                                    std::unique_ptr<ObjectStore> writes);

}  // namespace kvtd::storage::detail
