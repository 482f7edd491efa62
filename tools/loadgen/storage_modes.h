// storage_modes.h - kvtd-loadgen's storage modes (the daemons run with a storage backend).
//   storage-verify:     write blocks to storage, query, read them back into other blocks and
//                       check every byte; --storage-phase read lets a second engine process
//                       read what a first one stored (cross-session reuse).
//   storage-throughput: STORAGE_WRITE then STORAGE_READ of many blocks, GB/s.
//   storage-latency:    STORAGE_QUERY of one stored key: the agreement round trip, p50/p99.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "loadgen_common.h"

namespace kvtd::loadgen {

// Keys "<prefix>-<first>" ... "<prefix>-<first + n - 1>".
std::vector<std::string> block_keys(const std::string& prefix, std::size_t first, std::size_t n);
// One storage task, synchronously; the merged result, or nullopt after printing why it failed.
std::optional<engine::TaskResult> storage_task(EngineSession& s, TaskKind kind, const std::vector<std::string>& keys,
                                               const std::vector<std::int32_t>& blocks, bool host, double timeout_s,
                                               std::uint32_t min_hits = 0);

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
