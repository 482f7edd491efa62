// Pins a host pool for DMA in pieces: the pieces holding the first blocks on the caller's thread,
// the rest on background threads, lowest blocks first, so the daemon serves within seconds of
// mapping even a terabyte pool (pinning a MAP_SHARED pool ran at 3-4 GB/s on an H100 machine:
// minutes per terabyte). A swap waits only for the pieces its blocks are in. Each piece's pages
// are faulted in on the pinning threads in parallel, outside the driver; the registrations
// themselves run one at a time, with a pause after each for the serving threads' CUDA calls.
//
// The watermark: every block below pinned_blocks() is pinned in every region of the pool. Pieces
// are ordered by their first block, so it is the first block of the lowest piece not yet pinned.
//
// Ownership: the pinner unpins what it pinned when destroyed, after stopping its threads (each
// finishes the registration it is in). The memory must stay mapped until then.
// Thread-safety: pinned_blocks(), wait_pinned() and progress() from any thread; pin_first() and
// start_background() once each, in that order, from the owner's thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/host_pool.h"

namespace kvtd::daemon::detail {

struct PinPiece {
  std::byte* addr = nullptr;
  std::uint64_t bytes = 0;
  std::uint32_t first_block = 0;  // the lowest block with bytes in this piece
};

class PoolPinner {
 public:
  using OnProgress = std::function<void(std::uint64_t bytes_pinned, double seconds)>;
  // `pieces` ordered by first_block; `num_blocks` the pool's blocks (the watermark's end);
  // `on_progress` (may be empty) after each piece, from the thread that pinned it.
  PoolPinner(HostMemory& backend, std::vector<PinPiece> pieces, std::uint32_t num_blocks, OnProgress on_progress);
  ~PoolPinner();
  PoolPinner(const PoolPinner&) = delete;
  PoolPinner& operator=(const PoolPinner&) = delete;

  // Pins the pieces whose first block is 0 (their pages faulted in on `threads` threads first);
  // on failure unpins them and says which.
  Status<DeviceErrc> pin_first(std::uint32_t threads);
  // Pins the other pieces on `threads` threads (at least 1), lowest first.
  void start_background(std::uint32_t threads);

  std::uint32_t pinned_blocks() const { return watermark_.load(std::memory_order_acquire); }
  // Returns once blocks [0, end) are pinned; an error when pinning failed (naming the piece and
  // the driver's answer) or when `give_up` (polled every few milliseconds) returns a reason.
  // Every call that had to wait is counted in progress().
  Status<DeviceErrc> wait_pinned(std::uint32_t end, const std::function<std::optional<std::string>()>& give_up);

  HostPoolPinProgress progress() const;

 private:
  // Faults piece i in (unless `populated`) and registers it, one registration at a time.
  Status<DeviceErrc> pin_one(std::size_t i, bool populated);
  void background_loop();
  void advance_watermark() REQUIRES(mu_);
  std::string piece_text(std::size_t i) const;

  HostMemory& backend_;
  const std::vector<PinPiece> pieces_;
  const std::uint32_t num_blocks_;
  const OnProgress on_progress_;
  const std::uint64_t bytes_total_;  // of every piece
  std::unique_ptr<std::atomic<bool>[]> pinned_;  // per piece
  std::atomic<std::size_t> next_{0};             // the next piece a background thread takes
  std::atomic<bool> stop_{false};
  std::atomic<std::uint32_t> watermark_{0};
  std::atomic<std::uint64_t> bytes_pinned_{0}, waits_{0}, wait_ns_{0};
  std::atomic<std::size_t> registrations_{0};
  std::int64_t start_ns_ = 0;
  double first_seconds_ = 0;
  std::vector<std::thread> threads_;

  Mutex register_mu_;  // held across one registration: the pinning threads register one at a time
  mutable Mutex mu_;
  CondVar cv_;
  std::size_t lowest_unpinned_ GUARDED_BY(mu_) = 0;
  std::size_t threads_running_ GUARDED_BY(mu_) = 0;
  double all_seconds_ GUARDED_BY(mu_) = 0;
  std::string error_ GUARDED_BY(mu_);
};

}  // namespace kvtd::daemon::detail
