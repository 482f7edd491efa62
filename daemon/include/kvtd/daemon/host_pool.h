// kvtd/daemon/host_pool.h - the rank's host tier: one region per (layer, tensor) holding
// num_host_blocks blocks, carved from one backend allocation (pinned on CUDA).
//
// Ownership: the memory belongs to the backend that allocated it; the pool must not outlive it.
// Thread-safety: immutable after construction; the block bytes are guarded by task ordering.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvtd/daemon/device_backend.h"
#include "kvtd/proto/geometry.h"

namespace kvtd::daemon {

class HostPool {
 public:
  static Result<HostPool, DeviceErrc> allocate(DeviceBackend& backend, const proto::CacheGeometry& g);

  // Base of the region of (layer, kind), or null when the geometry has no such tensor.
  std::byte* region(std::uint32_t layer, proto::TensorKind kind) const {
    return regions_[layer * proto::kTensorKinds + static_cast<std::uint32_t>(kind)];
  }
  std::size_t total_bytes() const { return total_; }

 private:
  std::vector<std::byte*> regions_;
  std::size_t total_ = 0;
};

}  // namespace kvtd::daemon
