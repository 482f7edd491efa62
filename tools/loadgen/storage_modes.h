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

// The same modes for a session of cache groups (group_storage_modes.cpp): a block per key and
// group, the state saved at a task's last key; a load checked against each group's rule.
int run_group_storage_verify(EngineSession& s, const Options& o);
int run_group_storage_throughput(EngineSession& s, const Options& o);
// The blocks of a task of `n` keys in a session of cache groups (keys in blocks [0, n) of each
// block group, a state in slot 0 at the last key), group-major, -1 for none.
std::vector<std::int32_t> group_key_blocks(const EngineSession& s, std::size_t n);

}  // namespace kvtd::loadgen
