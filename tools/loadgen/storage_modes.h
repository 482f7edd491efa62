// storage_modes.h - kvtd-loadgen's storage modes (the daemons run with a storage backend).
//   storage-verify:     write blocks to storage, query, read them back into other blocks and
//                       check every byte; --storage-phase read lets a second engine process
//                       read what a first one stored (cross-session reuse).
//   storage-throughput: STORAGE_WRITE then STORAGE_READ of many blocks, GB/s.
//   storage-latency:    STORAGE_QUERY of one stored key: the agreement round trip, p50/p99.
#pragma once

#include "loadgen_common.h"

namespace kvtd::loadgen {

int run_storage_verify(EngineSession& s, const Options& o);
int run_storage_throughput(EngineSession& s, const Options& o);
int run_storage_latency(EngineSession& s, const Options& o);

}  // namespace kvtd::loadgen
