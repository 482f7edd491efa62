// kvtd/daemon/host_pool.h - the rank's host tier: num_host_blocks blocks of every (layer,
// tensor), in a shared-memory object that outlives the daemon process. Two layouts
// (--host-layout): layer_first, one packed region per (layer, tensor) like the device cache;
// page_first, every layer of one block contiguous (the stored-object order), so a block is one
// piece for storage backends and the transform happens in the swap copy (stride()).
//
// The object is named per session generation and rank ("kvtd_<uid>_<gen>_host<r>"), so a
// daemon restarted within the same session (a crash under Restart=on-failure, a SIGTERM and
// start) maps the same bytes again and loses nothing. The engine removes it when it closes the
// session. When the engine died instead, the daemon keeps it for the engine's restart to take
// over (SessionHeader::take_over_host_tier) and removes it once a session does not; the object
// names the daemon as its holder, and sweep_stale_objects() removes only what no live daemon
// holds and no live session owns. It is pinned for DMA (cudaHostRegister) by the CUDA backend and
// placed on the GPU's NUMA node before its pages are allocated.
//
// Every host block has a validity byte in the object: cleared before a write into the block
// starts, set once the write completed. A block that is not valid holds nothing this session
// wrote (the pool was lost and recreated, or a write into it failed or was cut short by a
// crash); reading it is a kHostTierLost failure, never stale bytes reported as ok.
//
// Ownership: HostPool owns its mapping and unpins it on destruction; the object itself stays
// unless remove() was called. Not copyable or movable (held by unique_ptr).
// Thread-safety: region() and the validity calls may be used from any thread; the block bytes
// themselves are guarded by task ordering (the runner's block tracker).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvtd/device_modes.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/proto/cache_groups.h"
#include "kvtd/proto/geometry.h"

namespace kvtd::ipc {
class LivenessLock;
}  // namespace kvtd::ipc

namespace kvtd::ipc {
class SharedObject;
}

namespace kvtd::daemon {
namespace detail {
class PoolPinner;
}

// What one pool holds: `host_blocks` blocks of `num_layers` layers, each layer with the same
// tensors (slot k: block_bytes[k] bytes per block, 0 = none). A single-shape geometry is one
// pool of every layer; a session with cache groups keeps one pool per group, of its layers.
// Plain value, standard layout (it is part of the pool object's header).
struct PoolShape {
  std::uint32_t num_layers = 0;
  std::uint32_t num_host_blocks = 0;
  std::uint64_t tensor_block_bytes[proto::kTensorKinds] = {};

  std::uint64_t block_bytes(proto::TensorKind k) const { return tensor_block_bytes[static_cast<std::uint32_t>(k)]; }
  // One block across every layer and tensor; 0 when that overflows kMaxSizeBytes.
  std::uint64_t block_bytes_all_layers() const;

  static PoolShape of(const proto::CacheGeometry& g);
  // Group `group`'s pool: its layers (in layer order), its tensors, its host blocks.
  static PoolShape of(const proto::CacheGroups& gs, std::uint32_t group);
  // A rank's pools of a session: one of `g` (groups all zero), else one per group, group order.
  static std::vector<PoolShape> of_session(const proto::CacheGeometry& g, const proto::CacheGroups& gs);
};
static_assert(std::is_standard_layout_v<PoolShape>);

// How the pool is pinned for DMA (the CUDA backend; the host backend pins nothing).
struct HostPoolPinPlan {
  // At most this many bytes per registration, each holding whole blocks and pages (drivers
  // refuse one cudaHostRegister of >= 512 GiB).
  std::uint64_t chunk_bytes = std::uint64_t{64} << 30;
  // open() pins the first blocks, about this many bytes of them across every region, before it
  // returns; the rest is pinned by `threads` background threads in slices of block ranges that
  // double in size, lowest blocks first. A pool no larger than this is pinned whole by open().
  std::uint64_t first_bytes = std::uint64_t{1} << 30;
  std::uint32_t threads = 4;
  // Called after each piece is pinned (from the pinning thread): bytes pinned so far, seconds
  // since pinning began. May be empty.
  std::function<void(std::uint64_t bytes_pinned, double seconds)> on_progress;
};

// How far pinning has got (HostPool::pin_progress).
struct HostPoolPinProgress {
  std::uint64_t bytes_pinned = 0, bytes_total = 0;
  std::size_t registrations = 0, pieces = 0;
  double first_seconds = 0;  // open()'s share: the first blocks
  double all_seconds = 0;    // until the last piece was pinned; 0 while pinning goes on
  std::uint64_t waits = 0, wait_ns = 0;  // calls of wait_pinned that had to wait, and for how long
  std::string error;         // a background pin failure
};

class HostPool {
 public:
  using PinPlan = HostPoolPinPlan;
  using PinProgress = HostPoolPinProgress;

  // Maps the pool of (generation, rank) if a previous daemon of this session left a complete one
  // with this geometry and layout, else creates it (after checking /dev/shm has room: the error
  // names the size and the free space), preferring `numa_node` for its pages (-1: anywhere), and
  // pins it as `pin` says. `hugetlbfs_dir`: empty for /dev/shm, else a hugetlbfs mount the pool is
  // a file in (huge pages: fewer TLB misses and page-table entries to pin); refused, naming the
  // counts, when the kernel has too few free.
  // `group`: which of the rank's pools (proto::host_pool_object names it), 0 for a single shape.
  // `take_over_generation` (nonzero): a dead session of the same suffix whose pool this daemon
  // kept (RankEndpoint::take_over_host_tier), taken over when this session has no pool yet and
  // that one is exactly ours but for the generation: renamed to this session's name, its blocks
  // kept; restored() is then true and adopted() names it. Every pool opened names this process
  // its holder (proto::HostPoolPrefix) and holds its lock (ipc::kPoolHolderLockByte), so no sweep
  // removes it while we live, from whatever pid namespace it runs in.
  static Result<std::unique_ptr<HostPool>, DeviceErrc> open(HostMemory& backend, const PoolShape& shape,
                                                            std::uint64_t generation, std::uint32_t rank,
                                                            std::uint32_t group, HostLayout layout = HostLayout::kLayerFirst,
                                                            int numa_node = -1, const PinPlan& pin = PinPlan(),
                                                            const std::string& hugetlbfs_dir = {},
                                                            std::uint64_t take_over_generation = 0);
  // The one pool of a single-shape geometry.
  static Result<std::unique_ptr<HostPool>, DeviceErrc> open(HostMemory& backend, const proto::CacheGeometry& g,
                                                            std::uint64_t generation, std::uint32_t rank,
                                                            HostLayout layout = HostLayout::kLayerFirst,
                                                            int numa_node = -1, const PinPlan& pin = PinPlan(),
                                                            const std::string& hugetlbfs_dir = {}) {
    return open(backend, PoolShape::of(g), generation, rank, 0, layout, numa_node, pin, hugetlbfs_dir);
  }
  // The generation whose pool open() took over, or 0.
  std::uint64_t adopted() const { return adopted_; }
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // Block 0 of (layer, kind), or null when the geometry has no such tensor; block b is
  // stride(kind) bytes further per block.
  std::byte* region(std::uint32_t layer, proto::TensorKind kind) const {
    return regions_[layer * proto::kTensorKinds + static_cast<std::uint32_t>(kind)];
  }
  // Bytes from one block of `kind` to the next: its block bytes (layer_first), or one block
  // across every layer and tensor (page_first).
  std::uint64_t stride(proto::TensorKind kind) const;
  std::size_t total_bytes() const { return total_; }
  // Bytes of each page the pool is mapped in (4096, or the huge page size in a hugetlbfs mount).
  std::uint64_t page_bytes() const { return page_bytes_; }
  // Blocks [0, pinned_blocks()) are pinned in every region (all blocks once pinning finished;
  // always all on a backend that pins nothing). Any thread.
  std::uint32_t pinned_blocks() const;
  // Returns once blocks [0, end) are pinned (at once when they are); an error naming why not when
  // background pinning failed or `give_up`, polled every few milliseconds, returns a reason. A
  // call that had to wait is counted (pin_progress().waits). Any thread.
  Status<DeviceErrc> wait_pinned(std::uint32_t end, const std::function<std::optional<std::string>()>& give_up);
  PinProgress pin_progress() const;
  // True if open() found and re-mapped a previous daemon's pool.
  bool restored() const { return restored_; }
  std::size_t valid_blocks() const;
  const std::string& name() const;

  // Before writing blocks: they hold nothing valid until mark_valid.
  void mark_invalid(std::span<const std::int32_t> ids);
  // After a write into blocks completed.
  void mark_valid(std::span<const std::int32_t> ids);
  // Every block: a weight update made all of them stale (CLEAR_CACHE with drop-host-tier).
  void mark_all_invalid();
  // The first of `ids` that holds no valid data, if any. Ids must be in range.
  std::optional<std::int32_t> first_invalid(std::span<const std::int32_t> ids) const;

  // --verify-swaps: block `id`'s checksums as it was swapped out (kvtd/kernels/checksum.h, one
  // per copy target: every set of a pool carries the same number, the first fixes it; others are
  // ignored), kept in this process only: a restarted daemon knows none for blocks written before
  // it. mark_invalid and mark_all_invalid forget them. The caller owns the block while it sets or
  // reads them (the block tracker's order); ids must be in range.
  void set_checksums(std::int32_t id, std::span<const std::uint64_t> sums);
  // The checksums kept for block `id`, or an empty span when none are.
  std::span<const std::uint64_t> checksums(std::int32_t id) const;

  // Unlinks the object: the session is over and nobody will need these bytes again.
  void remove();
  // Hands over this pool's holder lock (null when none was taken) to a caller that keeps the
  // object for later (a dead engine's restart), so the object keeps a live holder after this
  // HostPool is gone.
  std::unique_ptr<ipc::LivenessLock> release_holder_lock();

  // The page size of the hugetlbfs mount `dir`, or an error naming what it is instead (checked
  // at start-up, so a wrong --hugetlbfs-dir fails before any engine attaches).
  static Result<std::uint64_t, DeviceErrc> hugetlbfs_page_bytes(const std::string& dir);

  // Bytes the pool object of this geometry needs (header, validity map, regions); 0 on overflow.
  static std::uint64_t object_bytes(const PoolShape& shape, HostLayout layout = HostLayout::kLayerFirst);
  static std::uint64_t object_bytes(const proto::CacheGeometry& g, HostLayout layout = HostLayout::kLayerFirst) {
    return object_bytes(PoolShape::of(g), layout);
  }

 private:
  HostPool() = default;
  HostMemory* backend_ = nullptr;
  std::unique_ptr<ipc::SharedObject> object_;
  std::unique_ptr<ipc::LivenessLock> holder_lock_;  // ipc::kPoolHolderLockByte of object_
  // Declared after object_: destroyed (threads stopped, pieces unpinned) before the unmapping.
  std::unique_ptr<detail::PoolPinner> pinner_;
  std::uint8_t* valid_ = nullptr;
  std::uint32_t blocks_ = 0;
  // Per block: how many checksums are kept (0: none; released after the sums are written).
  std::unique_ptr<std::atomic<std::uint16_t>[]> sums_kept_;
  std::vector<std::uint64_t> sums_;  // blocks_ x sums_per_block_, allocated at the first set
  std::size_t sums_per_block_ = 0;
  std::once_flag sums_once_;
  std::vector<std::byte*> regions_;
  std::size_t total_ = 0;
  bool restored_ = false;
  std::uint64_t adopted_ = 0;
  std::uint64_t page_bytes_ = 4096;
  PoolShape shape_{};
  std::uint64_t page_stride_ = 0;  // 0: layer_first
};

// A rank's host pools: one per cache group (one for a single-shape geometry), group order.
// Owns them. Thread-safety: as HostPool's; the list is fixed once opened.
class HostPools {
 public:
  HostPools() = default;
  explicit HostPools(std::vector<std::unique_ptr<HostPool>> pools) : pools_(std::move(pools)) {}
  std::size_t size() const { return pools_.size(); }
  HostPool* at(std::size_t group) const { return group < pools_.size() ? pools_[group].get() : nullptr; }
  // Every pool's blocks invalid (a weight update made the host tier stale).
  void mark_all_invalid() {
    for (auto& p : pools_) p->mark_all_invalid();
  }
  // Unlinks every pool object (the session is over).
  void remove() {
    for (auto& p : pools_) p->remove();
  }
  // Every pool's holder lock (HostPool::release_holder_lock), for objects kept after the pools.
  std::vector<std::unique_ptr<ipc::LivenessLock>> release_holder_locks();
  std::size_t total_bytes() const {
    std::size_t n = 0;
    for (const auto& p : pools_) n += p->total_bytes();
    return n;
  }
  std::size_t valid_blocks() const {
    std::size_t n = 0;
    for (const auto& p : pools_) n += p->valid_blocks();
    return n;
  }

 private:
  std::vector<std::unique_ptr<HostPool>> pools_;
};

}  // namespace kvtd::daemon
