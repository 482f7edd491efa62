// kvtd/daemon/attached_cache.h - what one attach of a session's cache is to the runner: each cache
// group's copy targets, id spaces and host pool, and the serving settings built with them once per
// attach (cache_mapping builds it; the task runner and its swap lanes read it).
//
// Ownership: plain data; the pools, metrics registry and storage targets it points at are
// borrowed and outlive the runner that holds it. Thread-safety: read-only once built.
#pragma once

#include <cstdint>
#include <vector>

#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/kernels/host_copy.h"
#include "kvtd/metrics/registry.h"

namespace kvtd::daemon {

// One cache group's copy targets: a single-shape geometry is one group of every layer; a session
// with cache groups has one per group (kvtd/proto/group_slots.h).
struct GroupCache {
  std::vector<kernels::CopyTarget> to_host;    // each of its layers x tensors: device -> host
  std::vector<kernels::CopyTarget> to_device;  // the same pairs reversed
  std::vector<std::uint64_t> block_bytes;      // per tensor of a layer
  std::int64_t device_blocks = 0;              // ids a swap may use: valid in every layer
  std::int64_t host_blocks = 0;
  std::int64_t device_base = 0;                // its first id in a task's device (host) id space
  std::int64_t host_base = 0;
  std::uint32_t num_layers = 0;
  std::vector<std::uint32_t> layers;  // the session's layer of each of its layers, ascending
  HostPool* pool = nullptr;  // validity of its host blocks; borrowed, outlives the runner
};

// The copy targets of one attached cache, built once per attach.
struct AttachedCache {
  std::vector<GroupCache> groups;  // at least one
  bool group_session = false;      // the session declared cache groups
  std::int64_t device_blocks = 0;  // every group's ids: the task's id space
  std::int64_t host_blocks = 0;
  int numa_node = -1;        // the swap lanes run on this node's CPUs (-1: anywhere)
  std::int64_t summary_period_ns = 60'000'000'000;  // info summary while busy; 0 = none
  // Longest a swap waits for its engine event while the engine lives (0: only liveness and the
  // task's deadline bound it); past it the task fails with engine_event_not_fired.
  std::int64_t engine_event_timeout_ns = 60'000'000'000;
  config::VerifySwaps verify_swaps = config::VerifySwaps::kSampled;  // --verify-swaps
  metrics::MetricsRegistry* metrics = nullptr;      // borrowed; null: no metrics
  std::int64_t granted_ns = 0;  // monotonic time the session was granted (0: unknown), for the log
  StorageTargets storage;    // storage tasks (store null: they fail with storage_unavailable)
};

}  // namespace kvtd::daemon
