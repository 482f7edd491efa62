#include "pool_pinner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fmt/format.h>

#include "kvtd/daemon/log.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/populate.h"

namespace kvtd::daemon::detail {
namespace {

std::string size_text(std::uint64_t b) {
  char buf[32];
  if (b < (1ull << 30)) std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1ull << 20));
  else std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1ull << 30));
  return buf;
}

// A pause after each registration, in which no pinning thread calls the driver: a serving
// thread's CUDA call blocked behind the registration gets its turn (the driver's lock need not be
// fair). About 2% of a 4 ms registration (85 MiB of faulted-in pages at 21 GB/s).
constexpr auto kRegistrationGap = std::chrono::microseconds(100);

// Populates the pieces [from, to) on up to `threads` threads (this one among them) in parts of at
// most 64 MiB, so one large piece is faulted in by several threads too.
void populate_pieces(const std::vector<PinPiece>& pieces, std::size_t from, std::size_t to, std::uint32_t threads) {
  constexpr std::uint64_t kPart = std::uint64_t{64} << 20;
  std::vector<std::pair<std::byte*, std::uint64_t>> parts;
  for (std::size_t i = from; i < to; ++i)
    for (std::uint64_t at = 0; at < pieces[i].bytes; at += kPart)
      parts.emplace_back(pieces[i].addr + at, std::min(kPart, pieces[i].bytes - at));
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < parts.size();)
      ipc::populate_for_write(parts[i].first, parts[i].second);
  };
  std::vector<std::thread> helpers;
  for (std::uint32_t t = 1; t < std::min<std::size_t>(std::max<std::uint32_t>(threads, 1), parts.size()); ++t)
    helpers.emplace_back(work);
  work();
  for (auto& h : helpers) h.join();
}

}  // namespace

PoolPinner::PoolPinner(HostMemory& backend, std::vector<PinPiece> pieces, std::uint32_t num_blocks,
                       OnProgress on_progress)
    : backend_(backend),
      pieces_(std::move(pieces)),
      num_blocks_(num_blocks),
      on_progress_(std::move(on_progress)),
      bytes_total_([this] {
        std::uint64_t n = 0;
        for (const auto& piece : pieces_) n += piece.bytes;
        return n;
      }()),
      pinned_(std::make_unique<std::atomic<bool>[]>(pieces_.size())) {
  MutexLock g(mu_);
  advance_watermark();  // no pieces (nothing to pin): every block is usable
}

PoolPinner::~PoolPinner() {
  stop_.store(true, std::memory_order_release);
  for (auto& t : threads_) t.join();
  if (const std::uint64_t pinned = bytes_pinned_.load(std::memory_order_relaxed); pinned < bytes_total_ && start_ns_ != 0)
    KVTD_INFO("host pool closed while pinning: {} of {} pinned in {:.3f} s", size_text(pinned), size_text(bytes_total_),
              static_cast<double>(ipc::monotonic_now_ns() - start_ns_) / 1e9);
  for (std::size_t i = 0; i < pieces_.size(); ++i)
    if (pinned_[i].load(std::memory_order_acquire)) backend_.unpin_host(pieces_[i].addr);
}

std::string PoolPinner::piece_text(std::size_t i) const {
  return fmt::format("piece {} of {}, {} from block {}", i + 1, pieces_.size(), size_text(pieces_[i].bytes),
                     pieces_[i].first_block);
}

// Faulting a page of the MAP_SHARED pool into this process is most of what pinning it costs (H100
// machine: a fresh /dev/shm mapping pinned at 3.3 GB/s, the same pages pinned again at 21.7), and
// inside cudaHostRegister that work holds the driver: four threads registering at once pinned a
// 32 GiB pool at 2.3 GB/s and the first swap waited until they were all done (20 s). So each piece
// is faulted in first, outside the driver and on as many threads as pin, then registered alone.
Status<DeviceErrc> PoolPinner::pin_one(std::size_t i, bool populated) {
  if (!populated) ipc::populate_for_write(pieces_[i].addr, pieces_[i].bytes);
  Status<DeviceErrc> st;
  {
    MutexLock g(register_mu_);
    st = backend_.pin_host(pieces_[i].addr, pieces_[i].bytes);
    std::this_thread::sleep_for(kRegistrationGap);
  }
  if (!st.ok())
    return make_error(st.error().code, "pinning the host pool (" + piece_text(i) + "): " + st.error().message);
  pinned_[i].store(true, std::memory_order_release);
  const std::uint64_t bytes = bytes_pinned_.fetch_add(pieces_[i].bytes, std::memory_order_relaxed) + pieces_[i].bytes;
  registrations_.fetch_add(1, std::memory_order_relaxed);
  if (on_progress_) on_progress_(bytes, static_cast<double>(ipc::monotonic_now_ns() - start_ns_) / 1e9);
  return {};
}

Status<DeviceErrc> PoolPinner::pin_first(std::uint32_t threads) {
  start_ns_ = ipc::monotonic_now_ns();
  std::size_t first = 0;
  while (first < pieces_.size() && pieces_[first].first_block == 0) ++first;
  populate_pieces(pieces_, 0, first, threads);
  std::size_t i = 0;
  for (; i < first; ++i) {
    if (auto st = pin_one(i, /*populated=*/true); !st.ok()) {
      for (std::size_t j = 0; j < i; ++j)
        if (pinned_[j].exchange(false, std::memory_order_acq_rel)) backend_.unpin_host(pieces_[j].addr);
      return st;
    }
  }
  next_.store(i, std::memory_order_relaxed);
  first_seconds_ = static_cast<double>(ipc::monotonic_now_ns() - start_ns_) / 1e9;
  MutexLock g(mu_);
  advance_watermark();
  return {};
}

void PoolPinner::start_background(std::uint32_t threads) {
  const std::size_t left = pieces_.size() - std::min(pieces_.size(), next_.load(std::memory_order_relaxed));
  const std::size_t n = std::min<std::size_t>(std::max<std::uint32_t>(threads, 1), left);
  {
    MutexLock g(mu_);
    threads_running_ = n;
    if (n == 0) all_seconds_ = first_seconds_;
  }
  const std::uint64_t first = bytes_pinned_.load(std::memory_order_relaxed);
  if (n == 0 && !pieces_.empty())
    KVTD_INFO("host pool pinned: {} in {} registration{} ({:.3f} s, {:.2f} GB/s)", size_text(first), pieces_.size(),
              pieces_.size() == 1 ? "" : "s", first_seconds_,
              static_cast<double>(first) / std::max(first_seconds_, 1e-9) / 1e9);
  if (n > 0)
    KVTD_INFO("host pool: blocks below {} pinned ({}) in {:.3f} s, serving; the other {} pieces pinned on {} "
              "background thread{}",
              pinned_blocks(), size_text(first), first_seconds_, left, n, n == 1 ? "" : "s");
  for (std::size_t t = 0; t < n; ++t) threads_.emplace_back([this] { background_loop(); });
}

void PoolPinner::background_loop() {
  for (;;) {
    if (stop_.load(std::memory_order_acquire)) break;
    const std::size_t i = next_.fetch_add(1, std::memory_order_acq_rel);
    if (i >= pieces_.size()) break;
    auto st = pin_one(i, /*populated=*/false);
    MutexLock g(mu_);
    if (!st.ok()) {
      // The blocks from this piece on stay unusable; swaps needing them fail naming this.
      if (error_.empty()) error_ = st.error().message;
      KVTD_ERROR("{}; swaps of host blocks from {} on will fail", st.error().message, pieces_[i].first_block);
      stop_.store(true, std::memory_order_release);
      cv_.notify_all();
      break;
    }
    advance_watermark();
  }
  MutexLock g(mu_);
  if (--threads_running_ == 0 && error_.empty() && lowest_unpinned_ == pieces_.size()) {
    all_seconds_ = static_cast<double>(ipc::monotonic_now_ns() - start_ns_) / 1e9;
    const std::uint64_t bytes = bytes_pinned_.load(std::memory_order_relaxed);
    KVTD_INFO("host pool pinned: {} in {} registrations ({:.3f} s, {:.2f} GB/s; the first blocks after {:.3f} s)",
              size_text(bytes), pieces_.size(), all_seconds_, static_cast<double>(bytes) / std::max(all_seconds_, 1e-9) / 1e9,
              first_seconds_);
  }
  cv_.notify_all();
}

void PoolPinner::advance_watermark() {
  while (lowest_unpinned_ < pieces_.size() && pinned_[lowest_unpinned_].load(std::memory_order_acquire))
    ++lowest_unpinned_;
  watermark_.store(lowest_unpinned_ < pieces_.size() ? pieces_[lowest_unpinned_].first_block : num_blocks_,
                   std::memory_order_release);
  cv_.notify_all();
}

Status<DeviceErrc> PoolPinner::wait_pinned(std::uint32_t end,
                                           const std::function<std::optional<std::string>()>& give_up) {
  if (pinned_blocks() >= end) return {};
  const std::int64_t start = ipc::monotonic_now_ns();
  waits_.fetch_add(1, std::memory_order_relaxed);
  Status<DeviceErrc> out;
  for (;;) {
    {
      MutexLock g(mu_);
      // A short slice: give_up() (deadline, engine, shutdown) runs without the lock.
      cv_.wait_for(g, std::chrono::milliseconds(5),
                   [&]() REQUIRES(mu_) { return pinned_blocks() >= end || !error_.empty(); });
      if (pinned_blocks() >= end) break;
      if (!error_.empty()) {
        out = make_error(DeviceErrc::kAllocFailed,
                         fmt::format("host block {} and up are not pinned: {}", pinned_blocks(), error_));
        break;
      }
    }
    if (auto why = give_up()) {
      out = make_error(DeviceErrc::kAllocFailed,
                       fmt::format("host blocks up to {} were still being pinned (blocks below {} are): {}", end - 1,
                                   pinned_blocks(), *why));
      break;
    }
  }
  wait_ns_.fetch_add(static_cast<std::uint64_t>(ipc::monotonic_now_ns() - start), std::memory_order_relaxed);
  return out;
}

HostPoolPinProgress PoolPinner::progress() const {
  HostPoolPinProgress p;
  p.bytes_pinned = bytes_pinned_.load(std::memory_order_relaxed);
  p.bytes_total = bytes_total_;
  p.registrations = registrations_.load(std::memory_order_relaxed);
  p.pieces = pieces_.size();
  p.first_seconds = first_seconds_;
  p.waits = waits_.load(std::memory_order_relaxed);
  p.wait_ns = wait_ns_.load(std::memory_order_relaxed);
  MutexLock g(mu_);
  p.all_seconds = all_seconds_;
  p.error = error_;
  return p;
}

}  // namespace kvtd::daemon::detail
