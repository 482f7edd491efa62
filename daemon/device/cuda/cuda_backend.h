// cuda_backend.h (daemon-internal, CUDA builds only) - the CUDA device backend: the engine's
// tensors opened from IPC handles, one lane (stream, staging mirrors, events) per direction,
// copies enqueued by plan (runs by cudaMemcpyAsync; scattered blocks by cudaMemcpyBatchAsync or
// the copy kernels). cuda_backend.cpp: device memory and tensors; copy_lanes.cpp: the copies and
// the storage transforms; enqueue.cpp: the enqueue modes.
//
// Thread-safety: each lane's state is guarded by its mutex (one copy per direction at a time);
// tensor opening and memory calls come from the daemon's main thread while no copy runs.
#pragma once

#include <cuda.h>  // CUresult, CUdeviceptr: the driver entry point of allocation_bytes
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <optional>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/mirror.h"
#include "kvtd/base/mutex.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/kernels/cuda_copy.h"

namespace kvtd::daemon::cuda {

// The copy kernels' part of a block per warp, bytes (0: a warp per whole block), when fixed by
// KVTD_KERNEL_PIECE_KIB (a benchmark's sweep); unset (nullopt): whole blocks for a launch that
// fills the GPU, parts for a smaller one (kernels::pieces_to_fill). On an H100 (PCIe Gen5) parts
// of 4-32 KiB moved 256 blocks of 8-64 KiB within +-3% of whole blocks (docs/gpu.md): large
// launches need no parts.
std::optional<std::uint64_t> kernel_piece_bytes();

// Warps a copy launch should have, per SM: 2 CTAs of 8. The H100 sweep's 256 blocks x 16 tensors
// had about 31 per SM with whole blocks and reached 0.95-1.0x of one contiguous copy; launches of
// that size keep whole blocks, as measured.
inline constexpr std::uint64_t kFillWarpsPerSm = 16;

class CudaBackend final : public DeviceBackend {
  struct Lane;  // defined below; named early for the helpers' signatures

 public:
  // piece_bytes: the copy kernels move each block in parts of about this many bytes, one warp
  // per part (0: a warp per whole block; nullopt: parts only for launches too small to fill the
  // GPU); see kvtd/kernels/cuda_copy.h.
  // wait_spin_us: a lane polls for its copy's end in a window this wide around when it should
  // end, sleeping on the host before it (0: it blocks in the driver at once); see copy_wait.h.
  CudaBackend(int device, ScatterMode mode, std::size_t copy_batch_max, std::optional<std::uint64_t> piece_bytes,
              std::uint32_t wait_spin_us = 0)
      : device_(device),
        mode_(mode),
        copy_batch_max_(copy_batch_max),
        piece_bytes_(piece_bytes),
        wait_spin_us_(wait_spin_us) {}

  ~CudaBackend() override {
    close_tensors();  // drains both lanes first: nothing below is freed under a copy
    if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
    // Lanes release their mirrors, events and stream in their own destructors.
    for (void* p : host_) cudaFreeHost(p);
    for (auto [p, n] : registered_) {
      cudaHostUnregister(p);
      munmap(p, n);
    }
    for (void* p : device_allocs_) cudaFree(p);
    for (void* p : exported_) cudaFree(p);
  }

  Status<DeviceErrc> init();

  const char* name() const override { return "cuda"; }
  std::string device_footprint() override;

  // Logs the device's compute mode (a warning where the engine and kvtd cannot share it) and its
  // free memory once this daemon's context exists.
  void report_device_sharing();

  // Makes this backend's device current; every entry point calls it first.
  Status<DeviceErrc> use_device();

  Result<std::byte*, DeviceErrc> open_tensor(const proto::TensorDesc& d) override;

  // Waits for both lanes (their locks, then their streams) before unmapping anything, whatever
  // the caller did: a copy still running would otherwise read or write unmapped memory.
  void close_tensors() override;

  Result<std::byte*, DeviceErrc> alloc_host(std::size_t bytes) override;

  void free_host(std::byte* ptr) override;

  Status<DeviceErrc> pin_host(std::byte* addr, std::size_t bytes) override;

  void unpin_host(std::byte* addr) override;

  int numa_node() const override { return numa_node_; }
  bool broken() const override { return g_context_lost.load(std::memory_order_acquire); }

  Result<ExportedTensor, DeviceErrc> create_exported(std::size_t bytes, const std::string&) override;

  void free_exported() override;

  Result<std::byte*, DeviceErrc> alloc_device(std::size_t bytes) override;

  // On a lane's own stream, not cudaMemcpy: the legacy default stream does not wait for the
  // lanes' non-blocking streams, so a plain cudaMemcpy could race a copy still in flight there.
  Status<DeviceErrc> write_device(std::byte* dst, const std::byte* src, std::size_t bytes) override;

  Status<DeviceErrc> read_device(std::byte* dst, const std::byte* src, std::size_t bytes) override;

  Status<DeviceErrc> plain_copy(Lane& lane, std::byte* dst, const std::byte* src, std::size_t bytes);

  Status<DeviceErrc> copy(Direction dir, const kernels::CopyPlan& plan,
                          std::span<const kernels::CopyTarget> targets) override;

  Status<DeviceErrc> copy_layerwise(Direction dir, const kernels::CopyPlan& plan,
                                    std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                    const LayerCallback& on_layer_enqueued, const LayerCallback& on_layer_done) override;

  Status<DeviceErrc> copy_layerwise_locked(Lane& lane, const kernels::CopyPlan& plan,
                                           std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                           const LayerCallback& on_layer_enqueued, const LayerCallback& on_layer_done) REQUIRES(lane.mu);
  // Each layer's copy and its checksums on the stream with the layer's event behind both: in
  // kernel mode the layer's copy kernel sums (its plan cut into pairs), otherwise the checksum
  // kernel runs right after the layer's copy.
  Status<DeviceErrc> copy_layerwise_checked(Direction dir, const kernels::CopyPlan& plan,
                                            std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                            std::span<const std::int32_t> ids, const LayerCallback& on_layer_enqueued,
                                            const CheckedLayer& on_layer_checked) override;
  Status<DeviceErrc> copy_layerwise_checked_locked(Lane& lane, Direction dir, const kernels::CopyPlan& plan,
                                                   std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                                   std::span<const std::int32_t> ids,
                                                   const LayerCallback& on_layer_enqueued,
                                                   const CheckedLayer& on_layer_checked) REQUIRES(lane.mu);

  Result<std::vector<std::array<std::uint8_t, proto::kHandleBytes>>, DeviceErrc> export_layer_events(
      std::uint32_t layers) override;

  Status<DeviceErrc> await_engine_event(const std::array<std::uint8_t, proto::kEngineEventBytes>& handle,
                                        const GiveUp& give_up) override;

  std::int64_t busy_since_ns() const override;

  Result<std::vector<std::uint64_t>, DeviceErrc> device_checksums(Direction dir,
                                                                 std::span<const kernels::CopyTarget> targets,
                                                                 std::span<const std::int32_t> ids) override;

  Result<std::vector<std::uint64_t>, DeviceErrc> copy_with_checksums(Direction dir, const kernels::CopyPlan& plan,
                                                                    std::span<const kernels::CopyTarget> targets,
                                                                    std::span<const std::int32_t> ids) override;

  Status<DeviceErrc> gather_to_staging(std::span<const kernels::LayerTensor> tensors,
                                       std::span<const std::int32_t> ids, std::byte* staging) override;

  Status<DeviceErrc> scatter_from_staging(std::span<const kernels::LayerTensor> tensors,
                                          std::span<const std::int32_t> ids, const std::byte* staging) override;

 private:
  // A device table and what it holds. Owns its mirror, which only upload_table grows (after
  // clearing `contents`), so `contents` always describes the mirror it is next to.
  struct CachedTable {
    Mirror mirror;
    std::vector<std::byte> contents;  // what mirror.dev holds; empty: unknown
  };

  // One direction's stream and staging. Owns its stream, events and mirrors (RAII).
  struct Lane {
    // One copy at a time per direction: the mirrors and the batch arrays are rewritten by each.
    Mutex mu;
    cudaStream_t stream = nullptr;  // set once when the backend is made
    Mirror ids GUARDED_BY(mu);      // [single_src..., single_dst...] (int32) or staging ids
    // The tables the kernels index, each re-sent only when its bytes change (upload_table): the
    // swaps' CopyTargets, and the storage transforms' LayerTensors with their object offsets,
    // apart so that a backup after each swap-out (write-through) re-sends neither.
    CachedTable table GUARDED_BY(mu);
    CachedTable layout_table GUARDED_BY(mu);
    Mirror sums GUARDED_BY(mu);     // --verify-swaps: the checksum kernel's table, then its results
    std::vector<cudaEvent_t> events GUARDED_BY(mu);
    std::vector<void*> batch_dst GUARDED_BY(mu);
    std::vector<void*> batch_src GUARDED_BY(mu);
    std::vector<std::size_t> batch_size GUARDED_BY(mu);
    double bytes_per_ns GUARDED_BY(mu) = 0;  // the lane's recent copy rate (copy_wait.h), 0: unknown
    // When the copy now holding `mu` started (monotonic ns), 0 when none: the stuck-copy watchdog
    // reads it from another thread (busy_since_ns).
    std::atomic<std::int64_t> busy_since{0};

    Lane() = default;
    Lane(const Lane&) = delete;
    Lane& operator=(const Lane&) = delete;
    ~Lane() {
      drain();
      for (auto ev : events)
        if (cudaEventDestroy(ev) != cudaSuccess) (void)cudaGetLastError();
      if (stream && cudaStreamDestroy(stream) != cudaSuccess) (void)cudaGetLastError();
    }
    // Waits until nothing enqueued on the stream still runs; a failure (a broken context) is
    // cleared from the last-error slot: the task that met it already failed.
    void drain() {
      if (stream && cudaStreamSynchronize(stream) != cudaSuccess) (void)cudaGetLastError();
    }
  };

  Lane& lane_of(Direction d) { return lanes_[d == Direction::kToHost ? 0 : 1]; }
  // Waits until the `bytes` enqueued on the lane at `enqueued_ns` (monotonic) are done: a host
  // sleep, polls, then the driver's blocking wait, as copy_wait.h plans (copy_wait.cpp).
  Status<DeviceErrc> wait_lane(Lane& lane, std::uint64_t bytes, std::int64_t enqueued_ns) REQUIRES(lane.mu);

  // Marks `lane` busy from construction to destruction (one copy, under lane.mu).
  class BusyMark {
   public:
    explicit BusyMark(Lane& lane);
    ~BusyMark() { lane_.busy_since.store(0, std::memory_order_release); }
    BusyMark(const BusyMark&) = delete;
    BusyMark& operator=(const BusyMark&) = delete;

   private:
    Lane& lane_;
  };

  // copy, device_checksums and copy_with_checksums: the copy (when copy_first) and the checksum
  // kernel (when ids) enqueued on the lane's stream, one synchronisation. On failure the lane is
  // drained first: nothing enqueued still writes once the caller hears of it.
  Result<std::vector<std::uint64_t>, DeviceErrc> run_with_checksums(Direction dir, const kernels::CopyPlan& plan,
                                                                    std::span<const kernels::CopyTarget> targets,
                                                                    std::span<const std::int32_t> ids, bool copy_first);
  // Enqueues the checksum kernel over blocks `ids` of `targets`' device sides and the copy of its
  // results into the lane's pinned mirror; returns where they land once the stream is done.
  Result<const std::uint64_t*, DeviceErrc> enqueue_checksums(Lane& lane, Direction dir,
                                                             std::span<const kernels::CopyTarget> targets,
                                                             std::span<const std::int32_t> ids) REQUIRES(lane.mu);
  // The checksum kernel's inputs for every target, uploaded once (lane.sums: [table | ids |
  // results]), so that it can then run over any range of targets: results[t * ids + k].
  struct StagedChecksums {
    const kernels::LayerTensor* table = nullptr;  // device
    const std::int32_t* ids = nullptr;            // device
    std::size_t num_ids = 0;
    std::uint64_t* results = nullptr;             // device
    const std::uint64_t* host_results = nullptr;  // where the results land, in lane.sums.host
  };
  Result<StagedChecksums, DeviceErrc> stage_checksums(Lane& lane, Direction dir,
                                                      std::span<const kernels::CopyTarget> targets,
                                                      std::span<const std::int32_t> ids) REQUIRES(lane.mu);
  // The checksum kernel over targets [first, first + count) and the copy of their results home.
  Status<DeviceErrc> enqueue_staged_checksums(Lane& lane, const StagedChecksums& s, std::size_t first,
                                              std::size_t count) REQUIRES(lane.mu);

  // Per-layer events, interprocess so the engine can open them (which requires no timing).
  Status<DeviceErrc> ensure_events(Lane& lane, std::size_t layers) REQUIRES(lane.mu);

  // Uploads the scattered ids (and the target table for the all-layers kernel), followed in
  // the same upload by `sum_words` zeroed words at sums_offset(): the summing copy's results.
  Status<DeviceErrc> stage_plan(Lane& lane, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
                                std::size_t sum_words = 0) REQUIRES(lane.mu);
  // Where stage_plan puts the summing copy's words in lane.ids, for a plan of `singles` pairs.
  static std::size_t sums_offset(std::size_t singles) { return (2 * singles * sizeof(std::int32_t) + 7) / 8 * 8; }

  // Kernel mode's verified copy: the plan's every pair through the all-layers kernel, which sums
  // the bytes it moves (one pass over them, one launch), and the copy of the sums behind it.
  // Returns where the sums land once the stream is done (results[t * pairs + pair_of_id[k]] is
  // target t's sum of ids[k]); nullopt, with nothing enqueued, when some id is none of the plan's
  // device blocks (then the caller sums apart).
  struct SummingCopy {
    const std::uint64_t* results = nullptr;  // [target * pairs + pair], in lane.ids.host
    std::size_t pairs = 0;
    std::vector<std::size_t> pair_of_id;  // ids[k] is the device block of pair pair_of_id[k]
    kernels::CopyPlan plan;                 // the plan in pairs only (kernels::singles_only)
  };
  // The pairs of a summing copy of `plan` and which pair each of `ids` is; nullopt when some id
  // is none of the plan's device blocks. Pure.
  static std::optional<SummingCopy> summing_pairs(Direction dir, const kernels::CopyPlan& plan,
                                                  std::span<const std::int32_t> ids);
  Result<std::optional<SummingCopy>, DeviceErrc> enqueue_summing_copy(Lane& lane, Direction dir,
                                                                     const kernels::CopyPlan& plan,
                                                                     std::span<const kernels::CopyTarget> targets,
                                                                     std::span<const std::int32_t> ids) REQUIRES(lane.mu);

  // Uploads `bytes` into `t` (one of `lane`'s tables) unless it holds them already: the targets of
  // an attached cache never change, so steady-state tasks upload only their ids.
  Status<DeviceErrc> upload_table(Lane& lane, CachedTable& t, const void* table, std::size_t bytes) REQUIRES(lane.mu);

  // Enqueues runs and scattered blocks of `targets` (which start at index `first` of the staged
  // table). `all_layers` lets the all-layers kernel cover every target in one launch; `d_sums`
  // (that kernel only: kernel mode, all layers) makes it sum what it copies (cuda_copy.h).
  Status<DeviceErrc> enqueue(Lane& lane, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
                             bool all_layers, std::size_t first = 0, std::uint64_t* d_sums = nullptr) REQUIRES(lane.mu);

  Status<DeviceErrc> enqueue_batch(Lane& lane, const kernels::CopyPlan& plan,
                                   std::span<const kernels::CopyTarget> targets) REQUIRES(lane.mu);

  Status<DeviceErrc> transform(Lane& lane, std::span<const kernels::LayerTensor> tensors,
                               std::span<const std::int32_t> ids, std::byte* staging, bool gather);

  Status<DeviceErrc> transform_locked(Lane& lane, std::span<const kernels::LayerTensor> tensors,
                                      std::span<const std::int32_t> ids, std::byte* staging, bool gather) REQUIRES(lane.mu);

  // The engine's events, opened once per handle (cudaIpcOpenEventHandle) and destroyed by
  // close_tensors; at most kMaxEngineEvents, then the oldest set is let go (CUDA defers a
  // destroyed event's release until work waiting on it no longer needs it).
  static constexpr std::size_t kMaxEngineEvents = 4096;
  Result<cudaEvent_t, DeviceErrc> engine_event(const std::array<std::uint8_t, proto::kEngineEventBytes>& handle);
  void destroy_engine_events();
  void destroy_engine_events_locked() REQUIRES(engine_events_mu_);
  Mutex engine_events_mu_;
  std::map<std::array<std::uint8_t, proto::kEngineEventBytes>, cudaEvent_t> engine_events_ GUARDED_BY(engine_events_mu_);

  int device_;
  ScatterMode mode_;
  std::size_t copy_batch_max_;  // copies per cudaMemcpyBatchAsync call
  std::optional<std::uint64_t> piece_bytes_;  // the kernels' fixed part of a block per warp, if any
  std::uint32_t wait_spin_us_;  // copy_wait.h's poll window (0: block in the driver at once)
  std::uint64_t fill_warps_ = 108 * kFillWarpsPerSm;  // set by init() from the device's SMs
  // Parts per block for a launch of `warps` warps with whole blocks of at most `max_block_bytes`.
  std::uint32_t pieces(std::uint64_t max_block_bytes, std::uint64_t warps) const {
    return piece_bytes_ ? kernels::pieces_for(max_block_bytes, *piece_bytes_)
                        : kernels::pieces_to_fill(max_block_bytes, warps, fill_warps_);
  }
  std::array<Lane, 2> lanes_;
  // The bytes the allocation holds from `base` on (cuMemGetAddressRange); 0 when the driver
  // cannot say (then bounds go unchecked, with a warning).
  static std::uint64_t allocation_bytes(void* base);

  struct Opened {
    void* base;           // what cudaIpcOpenMemHandle returned
    std::uint64_t bytes;  // allocation_bytes(base)
  };
  std::map<std::array<std::uint8_t, proto::kHandleBytes>, Opened> opened_;
  std::vector<void*> host_;
  std::vector<void*> device_allocs_;
  std::vector<void*> exported_;  // create_exported: FastDeploy's worker maps these
  std::vector<std::pair<void*, std::size_t>> registered_;  // NUMA-placed, cudaHostRegister'ed
  int numa_node_ = -1;
  bool host_pointers_ = true;  // cudaDevAttrCanUseHostPointerForRegisteredMem
  std::uint32_t pci_bus_id_ = 0;  // proto/pci.h packing; 0 unknown
};

}  // namespace kvtd::daemon::cuda
