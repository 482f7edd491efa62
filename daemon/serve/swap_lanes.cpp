// The two swap lanes: queues, threads and the swaps they execute.
#include <algorithm>
#include <cstdio>
#include <fmt/format.h>
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
  for (const GroupCache& g : cache_.groups) {
    std::uint64_t sum = 0;
    for (auto bytes : g.block_bytes) sum += bytes * g.num_layers;
    group_block_bytes_.push_back(sum);
  }
}

void SwapLanes::start() {
  for (const Lane lane : kSwapLanes) queue_of(lane).thread = std::thread([this, lane] { lane_loop(lane); });
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
  for (const Lane lane : kSwapLanes) {
    std::deque<Work> q;
    {
      MutexLock g(queue_of(lane).mu);
      q.swap(queue_of(lane).queue);
    }
    for (auto& w : q) {
      tracker_.release(tracked_task(w), lane);
      queue_of(lane).outstanding.fetch_sub(1, std::memory_order_acq_rel);
      ++n;
    }
  }
  return n;
}

void SwapLanes::enqueue(Work&& w, Lane lane) {
  auto& l = queue_of(lane);
  l.outstanding.fetch_add(1, std::memory_order_acq_rel);
  {
    MutexLock g(l.mu);
    l.queue.push_back(std::move(w));
  }
  ipc::bump_and_wake(l.word, &l.waiters);
}

void SwapLanes::execute(Work& w, Lane lane) {
  const auto& h = w.header;
  const std::int64_t start = ipc::monotonic_now_ns();
  if (auto failed = prepare_swap(w, lane, start)) {
    reports_.swap_completed(h, proto::Outcome::failed(failed->first, failed->second), start, 0);
    return;
  }
  // Several groups layer by layer: copied here in the session's layer order; move_part then
  // settles each part (checksums, validity).
  const bool by_layer_here = (h.flags & proto::kTaskFlagLayerwise) != 0 && cache_.groups.size() > 1;
  if (by_layer_here) {
    if (auto st = copy_groups_layerwise(w); !st.ok()) {
      reports_.swap_completed(h, proto::Outcome::failed(status_of(st.error().code), st.error().message), start, 0);
      return;
    }
  }
  std::uint64_t blocks = 0;
  for (const SwapPart& p : w.parts) {
    if (auto failed = move_part(w, p, lane, by_layer_here)) {
      reports_.swap_completed(h, proto::Outcome::failed(failed->first, failed->second), start, 0);
      return;
    }
    blocks += static_cast<std::uint64_t>(p.plan.num_blocks);
  }
  reports_.swap_moved(lane, task_bytes(w));
  if (cache_.metrics != nullptr && cache_.group_session)
    for (const SwapPart& p : w.parts)
      cache_.metrics->group_swap_bytes(p.group, lane == Lane::kToHost ? metrics::Direction::kToHost : metrics::Direction::kToDevice,
                                       group_block_bytes_[p.group] * static_cast<std::uint64_t>(p.plan.num_blocks));
  reports_.swap_completed(h, proto::Outcome::swapped(blocks, ep_.geometry().num_layers), start, task_bytes(w));
  if (!first_swap_noted_.load(std::memory_order_relaxed)) note_first_swap(ipc::monotonic_now_ns());
}

Status<DeviceErrc> SwapLanes::copy_groups_layerwise(const Work& w) {
  const auto& h = w.header;
  ep_.progress_begin(h);
  std::vector<std::size_t> next(w.parts.size(), 0);  // each part's first target of its next layer
  std::vector<std::size_t> at(w.parts.size(), 0);    // each part's index into its group's layers
  const std::uint32_t layers = ep_.geometry().num_layers;
  for (std::uint32_t l = 0; l < layers; ++l) {
    for (std::size_t i = 0; i < w.parts.size(); ++i) {
      const GroupCache& g = cache_.groups[w.parts[i].group];
      if (at[i] >= g.layers.size() || g.layers[at[i]] != l) continue;
      const std::size_t per_layer = g.to_device.size() / g.num_layers;
      KVTD_TRY(copies_.copy(Direction::kToDevice, w.parts[i].plan,
                            std::span<const kernels::CopyTarget>(g.to_device.data() + next[i], per_layer)));
      next[i] += per_layer;
      ++at[i];
    }
    ep_.progress_update(h, l + 1, l + 1);
  }
  return {};
}

std::optional<SwapLanes::Failure> SwapLanes::move_part(const Work& w, const SwapPart& p, Lane lane, bool copied) {
  const GroupCache& g = cache_.groups[p.group];
  const auto& targets = lane == Lane::kToHost ? g.to_host : g.to_device;
  const std::string in_group = cache_.groups.size() > 1 ? fmt::format(" (cache group {})", p.group) : "";
  // --verify-swaps: the blocks whose checksums this swap takes (kept at swap-out, compared at swap-in).
  const VerifiedBlocks verify = blocks_to_verify(p, lane == Lane::kToDevice, targets.size());
  auto moved = copied ? (verify.device.empty() ? Result<std::vector<std::uint64_t>, DeviceErrc>(std::vector<std::uint64_t>{})
                                               : copies_.device_checksums(Direction::kToDevice, targets, verify.device))
                      : copy_swap(w, p, lane, verify);
  if (!moved.ok()) return std::make_pair(status_of(moved.error().code), moved.error().message + in_group);
  const std::vector<std::uint64_t>& sums = *moved;
  if (sums.size() != verify.device.size() * targets.size())
    return std::make_pair(TaskStatus::kDeviceError,
                          fmt::format("--verify-swaps: the device returned {} checksums for {} blocks x {} tensors{}",
                                      sums.size(), verify.device.size(), targets.size(), in_group));
  if (lane == Lane::kToHost && g.pool != nullptr) {
    // The checksums first: a block is valid only with what --verify-swaps checks it against.
    keep_checksums(p.group, verify, sums, targets.size());
    g.pool->mark_valid(p.host_ids);
  }
  if (lane == Lane::kToDevice && g.pool != nullptr)
    if (auto bad = check_checksums(p.group, verify, sums, targets.size())) return bad;
  return std::nullopt;
}

std::optional<SwapLanes::Failure> SwapLanes::prepare_swap(Work& w, Lane lane, std::int64_t start) {
  const auto& h = w.header;
  if (h.deadline_ns != 0 && start > h.deadline_ns)
    return std::make_pair(TaskStatus::kDeadlineExceeded,
                          fmt::format("deadline passed {} us before execution", (start - h.deadline_ns) / 1000));
  if (auto failed = await_pinned(w, lane, start))
    return std::make_pair(failed->first, failed->second + "; nothing was copied");
  for (const SwapPart& p : w.parts) {
    const GroupCache& g = cache_.groups[p.group];
    if (lane != Lane::kToDevice || g.pool == nullptr) continue;
    if (auto bad = g.pool->first_invalid(p.host_ids))
      return std::make_pair(TaskStatus::kHostTierLost,
                            fmt::format("host block {} holds no data written in this session (the host pool was lost "
                                        "with a daemon restart, or the write into it failed or never happened)",
                                        g.host_base + *bad));
  }
  for (const SwapPart& p : w.parts)
    if (lane == Lane::kToHost && cache_.groups[p.group].pool != nullptr) cache_.groups[p.group].pool->mark_invalid(p.host_ids);
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

Result<std::vector<std::uint64_t>, DeviceErrc> SwapLanes::copy_swap(const Work& w, const SwapPart& p, Lane lane,
                                                                    const VerifiedBlocks& verify) {
  const auto& h = w.header;
  const GroupCache& g = cache_.groups[p.group];
  const auto& targets = lane == Lane::kToHost ? g.to_host : g.to_device;
  if ((h.flags & proto::kTaskFlagLayerwise) == 0) {
    // The checksums ride behind the copy on its stream: one synchronisation for both.
    return copies_.copy_with_checksums(lane == Lane::kToHost ? Direction::kToHost : Direction::kToDevice, p.plan, targets,
                                       verify.device);
  }
  // Layer by layer: the decoder admits it only with one group (a single-shape session), whose
  // layers are the session's.
  ep_.progress_begin(h);
  std::uint32_t queued = 0, done = 0;
  const std::size_t per_layer = targets.size() / g.num_layers;
  auto enqueued = [&](std::uint32_t layer) {
    queued = layer + 1;
    ep_.progress_update(h, queued, done);  // the engine may cudaStreamWaitEvent from here
  };
  if (verify.device.empty()) {
    KVTD_TRY(copies_.copy_layerwise(Direction::kToDevice, p.plan, targets, per_layer, enqueued, [&](std::uint32_t layer) {
      done = layer + 1;
      ep_.progress_update(h, queued, done);
    }));
    return std::vector<std::uint64_t>{};
  }
  // --verify-swaps: each layer is checked before it is reported done, so an engine waiting for
  // the layer on the host (wait_layer) never runs on a layer that changed in host memory; the
  // first that differs holds back every later report, and move_part fails the task naming it.
  const std::size_t n = verify.device.size();
  std::vector<std::uint64_t> sums(targets.size() * n);  // device_checksums' layout, every layer
  bool differed = false, misshapen = false;
  KVTD_TRY(copies_.copy_layerwise_checked(
      Direction::kToDevice, p.plan, targets, per_layer, verify.device, enqueued,
      [&](std::uint32_t layer, std::span<const std::uint64_t> layer_sums) {
        const std::size_t first = std::size_t{layer} * per_layer;
        misshapen = misshapen || first >= targets.size() ||
                    layer_sums.size() != std::min(per_layer, targets.size() - first) * n;
        if (misshapen) return;  // reported below; no later layer is reported done
        std::copy(layer_sums.begin(), layer_sums.end(), sums.begin() + static_cast<std::ptrdiff_t>(first * n));
        differed = differed || check_checksums(p.group, verify, layer_sums, targets.size(), first).has_value();
        if (differed) return;
        done = layer + 1;
        ep_.progress_update(h, queued, done);
      }));
  if (misshapen)
    return make_error(DeviceErrc::kCopyFailed, "--verify-swaps: the device returned a layer's checksums in the wrong number");
  return sums;
}

std::optional<SwapLanes::Failure> SwapLanes::await_pinned(const Work& w, Lane lane, std::int64_t start) {
  for (const SwapPart& p : w.parts)
    if (auto failed = await_pinned_part(w, p, lane, start)) return failed;
  return std::nullopt;
}

std::optional<SwapLanes::Failure> SwapLanes::await_pinned_part(const Work& w, const SwapPart& p, Lane lane,
                                                                std::int64_t start) {
  HostPool* const pool = cache_.groups[p.group].pool;
  // Once the whole pool is pinned (always, on a backend that pins nothing) there is nothing to look up.
  if (pool == nullptr || p.host_ids.empty() || pool->pinned_blocks() >= cache_.groups[p.group].host_blocks)
    return std::nullopt;
  std::int32_t top = 0;
  for (auto id : p.host_ids) top = std::max(top, id);
  const auto end = static_cast<std::uint32_t>(top) + 1;
  if (pool->pinned_blocks() >= end) return std::nullopt;
  const auto& h = w.header;
  std::uint32_t seen = pool->pinned_blocks();
  std::int64_t progress_at = start;
  bool late = false;
  auto st = pool->wait_pinned(end, [&]() -> std::optional<std::string> {
    const std::int64_t now = ipc::monotonic_now_ns();
    if (const std::uint32_t pinned = pool->pinned_blocks(); pinned != seen) {
      seen = pinned;
      progress_at = now;
    }
    if (h.deadline_ns != 0 && now > h.deadline_ns) {
      late = true;
      return fmt::format("the task's deadline passed after {} ms of waiting", (now - start) / 1'000'000);
    }
    if (queue_of(lane).closing.load(std::memory_order_acquire)) return std::string("the cache is being released");
    if (now - progress_at > kPinStallNs)
      return fmt::format("pinning made no progress for {} s", kPinStallNs / 1'000'000'000);
    return std::nullopt;
  });
  if (cache_.metrics != nullptr) cache_.metrics->host_pool_pin_wait(ipc::monotonic_now_ns() - start);
  if (st.ok()) return std::nullopt;
  return std::make_pair(late ? TaskStatus::kDeadlineExceeded : TaskStatus::kDeviceError, st.error().message);
}

void SwapLanes::note_first_swap(std::int64_t now) {
  if (first_swap_noted_.exchange(true, std::memory_order_acq_rel) || cache_.granted_ns == 0) return;
  std::string pinned;
  HostPool* const pool = cache_.groups.empty() ? nullptr : cache_.groups[0].pool;
  const auto p = pool != nullptr ? pool->pin_progress() : HostPool::PinProgress{};
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
      return fmt::format("the task's deadline passed after {} ms of waiting", (now - start) / 1'000'000);
    if (bound_ns > 0 && now - start > bound_ns)
      return fmt::format("not within {} ms (--engine-event-timeout) while the engine lives", bound_ns / 1'000'000);
    if (queue_of(swap_lane_of(static_cast<TaskKind>(h.kind))).closing.load(std::memory_order_acquire))
      return "the daemon is stopping";
    return std::nullopt;
  });
}

void SwapLanes::lane_loop(Lane lane) {
  start_copy_thread(lane == Lane::kToHost ? "kvtd-lane0" : "kvtd-lane1", cache_.numa_node);
  auto& l = queue_of(lane);
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
      const std::int64_t now = ipc::monotonic_now_ns();
      const std::int64_t poll = std::max<std::int64_t>(20'000, l.poll_until_ns.load(std::memory_order_relaxed) - now);
      (void)ipc::wait_on_word(l.word, seen, now + kPollSliceNs, &l.waiters, poll);
      continue;
    }
    execute_and_release(w, lane);
    l.outstanding.fetch_sub(1, std::memory_order_acq_rel);
    expect_next_swap(lane);
  }
}

void SwapLanes::expect_next_swap(Lane lane) {
  // With one task in flight and the direction alternating, the dispatcher and the other lane had
  // slept through the whole copy, and the next submit waited for two wake-ups: on the 2-core VM a
  // task reached its lane 40-84 us after the submit; with this 12-38 us (1-64 blocks a task).
  constexpr std::int64_t kWindowNs = 200'000;
  const std::int64_t until = ipc::monotonic_now_ns() + kWindowNs;
  ep_.expect_task_soon(kWindowNs);
  for (std::size_t i = 0; i < std::size(lanes_); ++i) {
    lanes_[i].poll_until_ns.store(until, std::memory_order_relaxed);
    if (i != index_of(lane)) ipc::bump_and_wake(lanes_[i].word, &lanes_[i].waiters);  // asleep: poll now
  }
}

void SwapLanes::execute_and_release(Work& w, Lane lane) {
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
