// The two swap lanes: queues, threads and the swaps they execute.
#include <algorithm>
#include <cstdio>
#include <string>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/daemon/notify.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"
#include "swap_lanes.h"
#include "kvtd/daemon/status_of.h"

namespace kvtd::daemon {

using proto::TaskKind;
using proto::TaskStatus;

SwapLanes::SwapLanes(endpoint::RankEndpoint& ep, CopyEngine& copies, const AttachedCache& cache, BlockTracker& tracker,
                     SwapReports& reports)
    : ep_(ep), copies_(copies), cache_(cache), tracker_(tracker), reports_(reports) {
  for (auto bytes : cache_.block_bytes) block_bytes_all_layers_ += bytes * cache_.num_layers;
}

void SwapLanes::start() {
  for (int d = 0; d < 2; ++d) lanes_[d].thread = std::thread([this, d] { lane_loop(d); });
}

void SwapLanes::close() {
  for (auto& l : lanes_) {
    l.closing.store(true, std::memory_order_release);
    ipc::bump_and_wake(l.word, &l.waiters);
  }
  for (auto& l : lanes_)
    if (l.thread.joinable()) l.thread.join();
}

std::size_t SwapLanes::drop_queued() {
  std::size_t n = 0;
  for (int lane = 0; lane < 2; ++lane) {
    std::deque<Work> q;
    {
      MutexLock g(lanes_[lane].mu);
      q.swap(lanes_[lane].queue);
    }
    for (auto& w : q) {
      tracker_.release(tracked_task(w), lane);
      lanes_[lane].outstanding.fetch_sub(1, std::memory_order_acq_rel);
      ++n;
    }
  }
  return n;
}

void SwapLanes::enqueue(Work&& w, int lane) {
  auto& l = lanes_[lane];
  l.outstanding.fetch_add(1, std::memory_order_acq_rel);
  {
    MutexLock g(l.mu);
    l.queue.push_back(std::move(w));
  }
  ipc::bump_and_wake(l.word, &l.waiters);
}

void SwapLanes::execute(Work& w, int lane) {
  const auto& h = w.header;
  const std::int64_t start = ipc::monotonic_now_ns();
  if (auto failed = prepare_swap(w, lane, start)) {
    reports_.swap_completed(h, proto::Outcome::failed(failed->first, failed->second), start);
    return;
  }
  const auto& targets = lane == 0 ? cache_.to_host : cache_.to_device;
  // --verify-swaps: the blocks whose checksums this swap takes (kept at swap-out, compared at swap-in).
  const VerifiedBlocks verify = blocks_to_verify(w, lane == 1, targets.size());
  auto copied = copy_swap(w, lane, verify);
  if (!copied.ok()) {
    reports_.swap_completed(h, proto::Outcome::failed(status_of(copied.error().code), copied.error().message), start);
    return;
  }
  const std::vector<std::uint64_t>& sums = *copied;
  if (sums.size() != verify.device.size() * targets.size()) {
    reports_.swap_completed(h,
             proto::Outcome::failed(TaskStatus::kDeviceError,
                                    "--verify-swaps: the device returned " + std::to_string(sums.size()) +
                                        " checksums for " + std::to_string(verify.device.size()) + " blocks x " +
                                        std::to_string(targets.size()) + " tensors"),
             start);
    return;
  }
  if (lane == 0 && cache_.pool != nullptr) {
    // The checksums first: a block is valid only with what --verify-swaps checks it against.
    keep_checksums(verify, sums, targets.size());
    cache_.pool->mark_valid(w.host_ids);
  }
  if (lane == 1 && cache_.pool != nullptr) {
    if (auto bad = check_checksums(verify, sums, targets.size())) {
      reports_.swap_completed(h, proto::Outcome::failed(bad->first, bad->second), start);
      return;
    }
  }
  reports_.swap_moved(lane, task_bytes(w));
  reports_.swap_completed(h, proto::Outcome::swapped(static_cast<std::uint64_t>(w.plan.num_blocks), cache_.num_layers), start);
  if (!first_swap_noted_.load(std::memory_order_relaxed)) note_first_swap(ipc::monotonic_now_ns());
}

std::optional<SwapLanes::Failure> SwapLanes::prepare_swap(Work& w, int lane, std::int64_t start) {
  const auto& h = w.header;
  if (h.deadline_ns != 0 && start > h.deadline_ns)
    return std::make_pair(TaskStatus::kDeadlineExceeded,
                          "deadline passed " + std::to_string((start - h.deadline_ns) / 1000) + " us before execution");
  if (auto failed = await_pinned(w, lane, start))
    return std::make_pair(failed->first, failed->second + "; nothing was copied");
  if (lane == 1 && cache_.pool != nullptr) {
    if (auto bad = cache_.pool->first_invalid(w.host_ids))
      return std::make_pair(TaskStatus::kHostTierLost,
                            "host block " + std::to_string(*bad) +
                                " holds no data written in this session (the host pool was lost with a daemon restart, "
                                "or the write into it failed or never happened)");
  }
  if (lane == 0 && cache_.pool != nullptr) cache_.pool->mark_invalid(w.host_ids);
  // The engine's GPU work on these blocks first: its event must have fired before a byte moves.
  if (w.engine_event) {
    const auto st = await_engine_event(w, start);
    if (!st.ok() && st.error().code == DeviceErrc::kEventNotFired) {
      const bool late = h.deadline_ns != 0 && ipc::monotonic_now_ns() > h.deadline_ns;
      return std::make_pair(late ? TaskStatus::kDeadlineExceeded : status_of(st.error().code),
                            "the engine's event named in the task did not fire: " + st.error().message +
                                "; nothing was copied");
    }
    if (!st.ok()) return std::make_pair(status_of(st.error().code), st.error().message);
  }
  return std::nullopt;
}

Result<std::vector<std::uint64_t>, DeviceErrc> SwapLanes::copy_swap(const Work& w, int lane,
                                                                          const VerifiedBlocks& verify) {
  const auto& h = w.header;
  const auto& targets = lane == 0 ? cache_.to_host : cache_.to_device;
  if ((h.flags & proto::kTaskFlagLayerwise) == 0) {
    // The checksums ride behind the copy on its stream: one synchronisation for both.
    return copies_.copy_with_checksums(lane == 0 ? Direction::kToHost : Direction::kToDevice, w.plan, targets,
                                       verify.device);
  }
  ep_.progress_begin(h);
  std::uint32_t queued = 0, done = 0;
  KVTD_TRY(copies_.copy_layerwise(
      Direction::kToDevice, w.plan, targets, targets.size() / cache_.num_layers,
      [&](std::uint32_t layer) {
        queued = layer + 1;
        ep_.progress_update(h, queued, done);  // the engine may cudaStreamWaitEvent from here
      },
      [&](std::uint32_t layer) {
        done = layer + 1;
        ep_.progress_update(h, queued, done);
      }));
  if (verify.device.empty()) return std::vector<std::uint64_t>{};
  return copies_.device_checksums(Direction::kToDevice, targets, verify.device);
}

std::optional<SwapLanes::Failure> SwapLanes::await_pinned(const Work& w, int lane,
                                                                                  std::int64_t start) {
  // Once the whole pool is pinned (always, on a backend that pins nothing) there is nothing to look up.
  if (cache_.pool == nullptr || w.host_ids.empty() || cache_.pool->pinned_blocks() >= cache_.host_blocks)
    return std::nullopt;
  std::int32_t top = 0;
  for (auto id : w.host_ids) top = std::max(top, id);
  const auto end = static_cast<std::uint32_t>(top) + 1;
  if (cache_.pool->pinned_blocks() >= end) return std::nullopt;
  const auto& h = w.header;
  std::uint32_t seen = cache_.pool->pinned_blocks();
  std::int64_t progress_at = start;
  bool late = false;
  auto st = cache_.pool->wait_pinned(end, [&]() -> std::optional<std::string> {
    const std::int64_t now = ipc::monotonic_now_ns();
    if (const std::uint32_t p = cache_.pool->pinned_blocks(); p != seen) {
      seen = p;
      progress_at = now;
    }
    if (h.deadline_ns != 0 && now > h.deadline_ns) {
      late = true;
      return "the task's deadline passed after " + std::to_string((now - start) / 1'000'000) + " ms of waiting";
    }
    if (lanes_[lane].closing.load(std::memory_order_acquire)) return std::string("the cache is being released");
    if (now - progress_at > kPinStallNs)
      return "pinning made no progress for " + std::to_string(kPinStallNs / 1'000'000'000) + " s";
    return std::nullopt;
  });
  if (cache_.metrics != nullptr) cache_.metrics->host_pool_pin_wait(ipc::monotonic_now_ns() - start);
  if (st.ok()) return std::nullopt;
  return std::make_pair(late ? TaskStatus::kDeadlineExceeded : TaskStatus::kDeviceError, st.error().message);
}

void SwapLanes::note_first_swap(std::int64_t now) {
  if (first_swap_noted_.exchange(true, std::memory_order_acq_rel) || cache_.granted_ns == 0) return;
  std::string pinned;
  const auto p = cache_.pool != nullptr ? cache_.pool->pin_progress() : HostPool::PinProgress{};
  if (p.bytes_total != 0) {  // a backend that pins
    char buf[160];
    std::snprintf(buf, sizeof buf, "; host pool: first blocks pinned in %.3f s, %.2f of %.2f GiB pinned now",
                  p.first_seconds, static_cast<double>(p.bytes_pinned) / (1ull << 30),
                  static_cast<double>(p.bytes_total) / (1ull << 30));
    pinned = buf;
  }
  KVTD_INFO("first swap served {:.3f} s after the session was granted{}", static_cast<double>(now - cache_.granted_ns) / 1e9,
            pinned);
}

Status<DeviceErrc> SwapLanes::await_engine_event(const Work& w, std::int64_t start) {
  const auto& h = w.header;
  const std::int64_t bound_ns = cache_.engine_event_timeout_ns;
  return copies_.await_engine_event(*w.engine_event, [&]() -> std::optional<std::string> {
    const std::int64_t now = ipc::monotonic_now_ns();
    // A dead engine's pending record never completes (the exporter is gone): the heartbeat says so.
    if (!ep_.engine_alive()) return "the engine stopped heartbeating (it died or hangs) with its record still pending";
    if (h.deadline_ns != 0 && now > h.deadline_ns)
      return "the task's deadline passed after " + std::to_string((now - start) / 1'000'000) + " ms of waiting";
    if (bound_ns > 0 && now - start > bound_ns)
      return "not within " + std::to_string(bound_ns / 1'000'000) + " ms (--engine-event-timeout) while the engine lives";
    if (lanes_[lane_of(static_cast<TaskKind>(h.kind))].closing.load(std::memory_order_acquire))
      return "the daemon is stopping";
    return std::nullopt;
  });
}

void SwapLanes::lane_loop(int lane) {
  start_copy_thread(lane == 0 ? "kvtd-lane0" : "kvtd-lane1", cache_.numa_node);
  auto& l = lanes_[lane];
  for (;;) {
    const std::uint32_t seen = l.word.load(std::memory_order_acquire);
    Work w;
    bool have = false;
    {
      MutexLock g(l.mu);
      if (!l.queue.empty()) {
        w = std::move(l.queue.front());
        l.queue.pop_front();
        have = true;
      }
    }
    if (!have) {
      if (l.closing.load(std::memory_order_acquire)) return;  // queue drained
      (void)ipc::wait_on_word(l.word, seen, ipc::monotonic_now_ns() + kPollSliceNs, &l.waiters, 20'000);
      continue;
    }
    execute_and_release(w, lane);
    l.outstanding.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void SwapLanes::execute_and_release(Work& w, int lane) {
  // Checked right before touching memory: once the engine revoked the epoch this work was read
  // under, it has failed the task and may reuse its blocks, so the work is dropped unrun.
  if (w.epoch != ep_.epoch() || !ep_.granted()) {
    reports_.swaps_dropped(1);
  } else {
    execute(w, lane);
  }
  tracker_.release(tracked_task(w), lane);
}

}  // namespace kvtd::daemon
