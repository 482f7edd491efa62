// selftest_parts.h (daemon-internal) - the pieces of `kvtd selftest` (selftest.cpp: the bytes of
// every plan shape; selftest_bench.cpp: bandwidth and pinning; selftest_ipc.cpp: an engine in
// another process). Single-threaded; nothing here is shared between processes but pipes.
#pragma once

#include <array>
#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "kvtd/config/daemon_config.h"
#include "kvtd/daemon/device_backend.h"

namespace kvtd::daemon::selftest {

// PASS/FAIL lines and their counts.
struct Tally {
  int passed = 0;
  int failed = 0;
  void check(bool ok, const std::string& what, const std::string& detail = "") {
    (ok ? passed : failed)++;
    std::printf("%s  %s%s%s\n", ok ? "PASS" : "FAIL", what.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  }
};

// One bandwidth measurement: `blocks` blocks of `kib` KiB per tensor (key and value of
// `layers` layers) between engine-style device tensors and the daemon's host pool (shared
// memory, pinned as the daemon pins it, in `host_layout`); scattered ids or, `contiguous`,
// blocks 0..n-1 (one plain copy per tensor: the link's own figure); all layers at once or
// `layerwise` (one event per layer, as a layer-by-layer load runs).
struct BenchShape {
  std::uint32_t layers = 8;
  std::uint32_t kib = 32;
  std::uint32_t blocks = 256;
  bool contiguous = false;
  bool layerwise = false;
  HostLayout host_layout = HostLayout::kLayerFirst;
};

// Prints GB/s per direction; false (after a FAIL line) when a copy or an allocation failed.
// GB/s to host and to device, for the ratio of a scatter mode to the contiguous copy.
using Figures = std::array<double, 2>;
// Prints one bandwidth line per direction; with `reference` (the contiguous figures of this
// block size) each line carries its ratio to it. `out` (optional) receives the figures.
bool measure_bandwidth(DeviceBackend& backend, const std::string& mode, const BenchShape& shape,
                       const Figures* reference = nullptr, Figures* out = nullptr);

// Pins `mib` MiB of fresh pages in each way a host pool can be mapped and prints how fast (the
// pool's start-up cost), each as a ratio to private anonymous memory: private 4 KiB pages, a
// MAP_SHARED /dev/shm object (the default pool) in one call and on `threads` threads, and a file
// in the hugetlbfs mount `hugetlbfs_dir` (skipped, saying why, without one or free pages).
// selftest_pinning.cpp.
void measure_pinning(HostMemory& backend, std::uint32_t mib, std::uint32_t threads, const std::string& hugetlbfs_dir,
                     Tally& tally);

// The engine side of the cross-process check: a child forked before this process touches the
// device (a CUDA context does not survive fork), which allocates and fills tensors, exports
// their handles and events, and later checks what the daemon side wrote.
struct EnginePeer {
  pid_t pid = -1;
  int to_engine = -1;
  int from_engine = -1;
};
// Forks the engine for `backend_name` ("cuda" | "host") on `device_id`; pid -1 on failure.
EnginePeer start_engine_peer(const std::string& backend_name, int device_id);
// The daemon side: opens the engine's tensors and events through `backend`, swaps to host and
// back, and has the engine check the bytes. Reaps the peer.
void check_across_processes(DeviceBackend& backend, EnginePeer& peer, Tally& tally);

}  // namespace kvtd::daemon::selftest
