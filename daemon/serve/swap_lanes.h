// swap_lanes.h (daemon/serve private) - the two swap lanes (device -> host, host -> device): their
// queues and threads, and the swaps they execute: the checks before a byte moves (deadline, host
// blocks pinned and valid, the engine's event), the copy (whole, or layer by layer with progress
// for the engine), --verify-swaps' checksums, and the host blocks' validity after it.
//
// Threads: one per lane runs its queue in order; run_inline() runs a swap on the caller's thread
// (the dispatcher's, for a small swap when its lane is idle). Each lane's queue has its own lock,
// never held across a copy or a wait. Not copyable.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "block_tracker.h"
#include "kvtd/base/mutex.h"
#include "kvtd/daemon/attached_cache.h"
#include "kvtd/daemon/task_runner.h"
#include "work.h"

namespace kvtd::daemon {

// Where the lanes report, implemented by the task runner; called on the lane threads (and on the
// dispatcher for inline runs).
class SwapReports {
 public:
  virtual ~SwapReports() = default;
  // `bytes`: what the swap moved (every group's blocks, each at its own size); 0 when it failed.
  virtual void swap_completed(const proto::TaskRecordHeader& h, const proto::Outcome& o, std::int64_t start_ns,
                              std::uint64_t bytes) = 0;
  // `bytes` moved by a swap that completed ok on `lane` (a swap lane).
  virtual void swap_moved(Lane lane, std::uint64_t bytes) = 0;
  // `n` swaps of a revoked epoch dropped unrun (the engine has failed them already).
  virtual void swaps_dropped(std::size_t n) = 0;
};

class SwapLanes {
 public:
  static constexpr std::int64_t kPinStallNs = 60'000'000'000;  // a pin wait gives up past this without progress

  // Everything given outlives the lanes; a swap's blocks are released in `tracker` once it ends.
  SwapLanes(endpoint::RankEndpoint& ep, CopyEngine& copies, const AttachedCache& cache, BlockTracker& tracker,
            SwapReports& reports);
  SwapLanes(const SwapLanes&) = delete;
  SwapLanes& operator=(const SwapLanes&) = delete;

  void start();  // the lane threads
  // Closes the lanes: each drains its queue, then its thread ends and is joined.
  void close();
  void enqueue(Work&& w, Lane lane);
  // Runs `w` on this thread and releases its blocks (unrun if its epoch was revoked).
  void run_inline(Work& w, Lane lane) { execute_and_release(w, lane); }
  bool idle(Lane lane) const { return queue_of(lane).outstanding.load(std::memory_order_acquire) == 0; }
  // What one block moves, every layer and tensor (of the first group: a session with several cache
  // groups reports each swap's exact bytes with its completion); and what a swap's blocks move.
  std::uint64_t block_bytes() const { return group_block_bytes_.empty() ? 0 : group_block_bytes_[0]; }
  std::uint64_t task_bytes(const Work& w) const {
    std::uint64_t sum = 0;
    for (const SwapPart& p : w.parts) sum += group_block_bytes_[p.group] * static_cast<std::uint64_t>(p.plan.num_blocks);
    return sum;
  }
  // Removes every queued (not yet executing) swap, its blocks released; how many.
  std::size_t drop_queued();

 private:
  struct LaneQueue {  // one swap lane's queue and thread
    Mutex mu;
    std::deque<Work> queue GUARDED_BY(mu);
    std::atomic<std::uint32_t> word{0};
    std::atomic<std::uint32_t> waiters{0};
    std::atomic<bool> closing{false};
    std::atomic<std::uint32_t> outstanding{0};  // queued or executing
    std::atomic<std::int64_t> poll_until_ns{0};  // expect_next_swap(): the lane polls until then
    std::thread thread;
  };
  // The blocks of a swap whose checksums are taken: at swap-out its sampled (device, host)
  // pairs; at swap-in those of them whose host block has checksums kept in this process.
  struct VerifiedBlocks {
    std::vector<std::int32_t> device, host;
  };
  using Failure = std::pair<proto::TaskStatus, std::string>;
  LaneQueue& queue_of(Lane lane) { return lanes_[index_of(lane)]; }
  const LaneQueue& queue_of(Lane lane) const { return lanes_[index_of(lane)]; }

  void lane_loop(Lane lane);
  // After a swap: the dispatcher and the other lanes poll for the next task for a while (a caller
  // with one task in flight submits right after the completion, often in the other direction),
  // so it does not wait for sleeping threads' wake-ups.
  void expect_next_swap(Lane lane);
  void execute_and_release(Work& w, Lane lane);
  void execute(Work& w, Lane lane);
  // Why swap `w` cannot start, or nullopt: its deadline passed, its host blocks are not pinned
  // (after a bounded wait) or hold nothing valid (swap-in), or the engine's event never fired.
  // Marks a swap-out's host blocks invalid before the copy may touch them.
  std::optional<Failure> prepare_swap(Work& w, Lane lane, std::int64_t start);
  // Waits until the host pool has pinned every host block of `w` (it pins in the background
  // after its first blocks), bounded by the deadline, the lane's closing and kPinStallNs without
  // progress; counted in the metrics when it had to wait.
  std::optional<Failure> await_pinned(const Work& w, Lane lane, std::int64_t start);
  std::optional<Failure> await_pinned_part(const Work& w, const SwapPart& p, Lane lane, std::int64_t start);
  // Waits on the host for `w`'s engine event, bounded by the engine's liveness, the deadline,
  // cache.engine_event_timeout_ns and the lane's closing (kEventNotFired past them).
  Status<DeviceErrc> await_engine_event(const Work& w, std::int64_t start);
  // Runs part `p` of `w`'s copy and returns the checksums of `verify`'s device blocks taken after it.
  Result<std::vector<std::uint64_t>, DeviceErrc> copy_swap(const Work& w, const SwapPart& p, Lane lane,
                                                           const VerifiedBlocks& verify);
  // Copies part `p` and settles its host blocks: valid after a swap-out (with their checksums),
  // compared after a swap-in. The failure, or nullopt.
  std::optional<Failure> move_part(const Work& w, const SwapPart& p, Lane lane, bool copied = false);
  // A layer-by-layer load naming several cache groups: for each of the session's layers in
  // order, that layer's tensors of every part, then its progress (queued and done at once: each
  // copy has completed when it returns, so no per-layer event is recorded; an engine waiting on
  // one finds it complete).
  Status<DeviceErrc> copy_groups_layerwise(const Work& w);
  // Logs the first swap served since the session was granted (time to first swap), once.
  void note_first_swap(std::int64_t now);

  // ---- swap_checksums.cpp (--verify-swaps) ----
  // Ids in `p`'s group (its host pool's blocks).
  VerifiedBlocks blocks_to_verify(const SwapPart& p, bool swap_in, std::size_t targets) const;
  // After a swap-out: keeps `sums` (device_checksums' layout) with the host blocks of `group`.
  void keep_checksums(std::uint32_t group, const VerifiedBlocks& v, std::span<const std::uint64_t> sums,
                      std::size_t targets);
  // After a swap-in: compares `sums`, those of targets [first, first + sums.size() / blocks) of the
  // `targets` the group has (all of them, or one layer of a layer-by-layer swap-in checked before
  // it is reported), with those kept at swap-out; the integrity failure, or nullopt.
  std::optional<Failure> check_checksums(std::uint32_t group, const VerifiedBlocks& v,
                                         std::span<const std::uint64_t> sums, std::size_t targets,
                                         std::size_t first = 0) const;

  endpoint::RankEndpoint& ep_;
  CopyEngine& copies_;
  const AttachedCache& cache_;
  BlockTracker& tracker_;
  SwapReports& reports_;
  std::vector<std::uint64_t> group_block_bytes_;  // per group: one block, every layer and tensor
  std::atomic<bool> first_swap_noted_{false};
  LaneQueue lanes_[std::size(kSwapLanes)];  // by index_of(lane)
};

}  // namespace kvtd::daemon
