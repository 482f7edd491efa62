// The CUDA backend's copies: each direction's lane runs one copy at a time, whole or layer by
// layer with per-layer interprocess events, and the storage gather / scatter transforms.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <unordered_map>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/kernels/checksum.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/proto/pci.h"

namespace kvtd::daemon::cuda {

Status<DeviceErrc> CudaBackend::write_device(std::byte* dst, const std::byte* src, std::size_t bytes) {
  return plain_copy(lane_of(Direction::kToDevice), dst, src, bytes);
}

Status<DeviceErrc> CudaBackend::read_device(std::byte* dst, const std::byte* src, std::size_t bytes) {
  return plain_copy(lane_of(Direction::kToHost), dst, src, bytes);
}

Status<DeviceErrc> CudaBackend::plain_copy(Lane& lane, std::byte* dst, const std::byte* src, std::size_t bytes) {
  MutexLock g(lane.mu);
  BusyMark busy(lane);
  KVTD_CUDA_TRY(cudaSetDevice(device_));
  auto st = [&]() REQUIRES(lane.mu) -> Status<DeviceErrc> {
    const std::int64_t enqueued = ipc::monotonic_now_ns();
    KVTD_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, lane.stream));
    return wait_lane(lane, bytes, enqueued);
  }();
  if (!st.ok()) lane.drain();
  return st;
}

Status<DeviceErrc> CudaBackend::copy(Direction dir, const kernels::CopyPlan& plan,
                        std::span<const kernels::CopyTarget> targets) {
  KVTD_TRY(run_with_checksums(dir, plan, targets, {}, /*copy_first=*/true));
  return {};
}

Status<DeviceErrc> CudaBackend::copy_layerwise(Direction dir, const kernels::CopyPlan& plan,
                                  std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                  const LayerCallback& on_layer_enqueued, const LayerCallback& on_layer_done) {
  if (per_layer == 0) return {};
  Lane& lane = lane_of(dir);
  MutexLock g(lane.mu);
  BusyMark busy(lane);
  KVTD_CUDA_TRY(cudaSetDevice(device_));
  auto st = copy_layerwise_locked(lane, plan, targets, per_layer, on_layer_enqueued, on_layer_done);
  if (!st.ok()) lane.drain();  // as in copy(): nothing may still write once we report failure
  return st;
}

Status<DeviceErrc> CudaBackend::copy_layerwise_locked(Lane& lane, const kernels::CopyPlan& plan,
                                         std::span<const kernels::CopyTarget> targets, std::size_t per_layer,
                                         const LayerCallback& on_layer_enqueued, const LayerCallback& on_layer_done) {
  KVTD_TRY(stage_plan(lane, plan, targets));
  const std::size_t layers = (targets.size() + per_layer - 1) / per_layer;
  KVTD_TRY(ensure_events(lane, layers));
  // Enqueue every layer with an event after it, then report layers as their events fire, so
  // the copy of layer l+1 overlaps the engine's use of layer l.
  for (std::size_t l = 0; l < layers; ++l) {
    const std::size_t first = l * per_layer;
    const auto layer_targets = targets.subspan(first, std::min(per_layer, targets.size() - first));
    KVTD_TRY(enqueue(lane, plan, layer_targets, /*all_layers=*/false, first));
    KVTD_CUDA_TRY(cudaEventRecord(lane.events[l], lane.stream));
    if (on_layer_enqueued) on_layer_enqueued(static_cast<std::uint32_t>(l));
  }
  for (std::size_t l = 0; l < layers; ++l) {
    KVTD_CUDA_TRY(cudaEventSynchronize(lane.events[l]));
    if (on_layer_done) on_layer_done(static_cast<std::uint32_t>(l));
  }
  return {};
}

Result<std::vector<std::array<std::uint8_t, proto::kHandleBytes>>, DeviceErrc> CudaBackend::export_layer_events(
    std::uint32_t layers) {
  Lane& lane = lane_of(Direction::kToDevice);
  MutexLock g(lane.mu);
  if (auto e = cudaSetDevice(device_); e != cudaSuccess) return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaSetDevice", e));
  KVTD_TRY(ensure_events(lane, layers));
  std::vector<std::array<std::uint8_t, proto::kHandleBytes>> out(layers);
  for (std::uint32_t l = 0; l < layers; ++l) {
    cudaIpcEventHandle_t h{};
    static_assert(sizeof h == proto::kHandleBytes);
    if (auto e = cudaIpcGetEventHandle(&h, lane.events[l]); e != cudaSuccess)
      return make_error(DeviceErrc::kCopyFailed, cuda_text("cudaIpcGetEventHandle", e));
    std::memcpy(out[l].data(), &h, sizeof h);
  }
  return out;
}

Result<cudaEvent_t, DeviceErrc> CudaBackend::engine_event(
    const std::array<std::uint8_t, proto::kEngineEventBytes>& handle) {
  MutexLock g(engine_events_mu_);
  if (auto it = engine_events_.find(handle); it != engine_events_.end()) return it->second;
  if (engine_events_.size() >= kMaxEngineEvents) destroy_engine_events_locked();
  cudaIpcEventHandle_t h{};
  static_assert(sizeof h == proto::kEngineEventBytes);
  std::memcpy(&h, handle.data(), sizeof h);
  cudaEvent_t ev{};
  if (auto e = cudaIpcOpenEventHandle(&ev, h); e != cudaSuccess)
    return make_error(errc_of(e), cuda_text("opening the engine's event (cudaIpcOpenEventHandle)", e));
  engine_events_.emplace(handle, ev);
  return ev;
}

void CudaBackend::destroy_engine_events() {
  MutexLock g(engine_events_mu_);
  destroy_engine_events_locked();
}

void CudaBackend::destroy_engine_events_locked() {
  for (auto& [h, ev] : engine_events_)
    if (cudaEventDestroy(ev) != cudaSuccess) (void)cudaGetLastError();
  engine_events_.clear();
}

Status<DeviceErrc> CudaBackend::await_engine_event(const std::array<std::uint8_t, proto::kEngineEventBytes>& handle,
                                                   const GiveUp& give_up) {
  KVTD_CUDA_TRY(cudaSetDevice(device_));
  KVTD_ASSIGN_OR_RETURN(const cudaEvent_t ev, engine_event(handle));
  // The engine records its event just before it submits, so it usually fired already or fires
  // within microseconds: spin first, then back off to a 1 ms poll. The poll costs one driver call;
  // a device-side wait would cost nothing, but could never be taken back (see the header).
  std::int64_t pause_ns = 0;
  for (int polls = 0;; ++polls) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return {};
    if (e != cudaErrorNotReady)
      return make_error(errc_of(e), cuda_text("cudaEventQuery (the engine's event)", e));
    if (polls < 64) continue;
    if (auto why = give_up ? give_up() : std::nullopt) return make_error(DeviceErrc::kEventNotFired, *why);
    pause_ns = std::min<std::int64_t>(pause_ns == 0 ? 2'000 : pause_ns * 2, 1'000'000);
    std::this_thread::sleep_for(std::chrono::nanoseconds(pause_ns));
  }
}

Result<CudaBackend::StagedChecksums, DeviceErrc> CudaBackend::stage_checksums(
    Lane& lane, Direction dir, std::span<const kernels::CopyTarget> targets, std::span<const std::int32_t> ids) {
  // The device side of each target, as the checksum kernel's table, and the blocks' ids, in one
  // mirror [table | ids | results] uploaded by one copy: lane.ids may still feed a copy enqueued
  // before on this stream, so the checksum's ids never share it.
  std::vector<kernels::LayerTensor> table;
  table.reserve(targets.size());
  for (const auto& t : targets)
    table.push_back(dir == Direction::kToHost
                        ? kernels::LayerTensor{const_cast<std::byte*>(t.src), t.block_bytes, t.src_stride}
                        : kernels::LayerTensor{t.dst, t.block_bytes, t.dst_stride});
  const auto round8 = [](std::size_t n) { return (n + 7) / 8 * 8; };
  const std::size_t table_bytes = table.size() * sizeof(kernels::LayerTensor);
  const std::size_t ids_at = round8(table_bytes);
  const std::size_t results_at = round8(ids_at + ids.size_bytes());
  const std::size_t out_bytes = targets.size() * ids.size() * sizeof(std::uint64_t);
  KVTD_TRY(lane.sums.reserve(results_at + out_bytes));
  auto* host = static_cast<std::byte*>(lane.sums.host);
  auto* dev = static_cast<std::byte*>(lane.sums.dev);
  std::memcpy(host, table.data(), table_bytes);
  std::memcpy(host + ids_at, ids.data(), ids.size_bytes());
  KVTD_TRY(lane.sums.upload(ids_at + ids.size_bytes(), lane.stream));
  StagedChecksums s;
  s.table = reinterpret_cast<const kernels::LayerTensor*>(dev);
  s.ids = reinterpret_cast<const std::int32_t*>(dev + ids_at);
  s.num_ids = ids.size();
  s.results = reinterpret_cast<std::uint64_t*>(dev + results_at);
  s.host_results = reinterpret_cast<const std::uint64_t*>(host + results_at);
  return s;
}

Status<DeviceErrc> CudaBackend::enqueue_staged_checksums(Lane& lane, const StagedChecksums& s, std::size_t first,
                                                         std::size_t count) {
  const std::size_t at = first * s.num_ids;
  const int e = kernels::launch_block_checksums(s.table + first, static_cast<std::uint32_t>(count), s.ids,
                                                static_cast<std::int64_t>(s.num_ids), s.results + at, lane.stream);
  if (e != 0)
    return make_error(errc_of(static_cast<cudaError_t>(e)), cuda_text("checksum kernel", static_cast<cudaError_t>(e)));
  KVTD_CUDA_TRY(cudaMemcpyAsync(const_cast<std::uint64_t*>(s.host_results) + at, s.results + at,
                                count * s.num_ids * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, lane.stream));
  return {};
}

Result<const std::uint64_t*, DeviceErrc> CudaBackend::enqueue_checksums(Lane& lane, Direction dir,
                                                                       std::span<const kernels::CopyTarget> targets,
                                                                       std::span<const std::int32_t> ids) {
  KVTD_ASSIGN_OR_RETURN(const StagedChecksums staged, stage_checksums(lane, dir, targets, ids));
  KVTD_TRY(enqueue_staged_checksums(lane, staged, 0, targets.size()));
  return staged.host_results;
}

Result<std::vector<std::uint64_t>, DeviceErrc> CudaBackend::device_checksums(
    Direction dir, std::span<const kernels::CopyTarget> targets, std::span<const std::int32_t> ids) {
  return run_with_checksums(dir, kernels::CopyPlan{}, targets, ids, /*copy_first=*/false);
}

Result<std::vector<std::uint64_t>, DeviceErrc> CudaBackend::copy_with_checksums(
    Direction dir, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
    std::span<const std::int32_t> ids) {
  return run_with_checksums(dir, plan, targets, ids, /*copy_first=*/true);
}

std::optional<CudaBackend::SummingCopy> CudaBackend::summing_pairs(Direction dir, const kernels::CopyPlan& plan,
                                                                   std::span<const std::int32_t> ids) {
  SummingCopy c;
  c.plan = kernels::singles_only(plan);
  const std::vector<std::int32_t>& device_side = dir == Direction::kToHost ? c.plan.single_src : c.plan.single_dst;
  std::unordered_map<std::int32_t, std::size_t> pair_of_block;
  pair_of_block.reserve(device_side.size());
  for (std::size_t i = 0; i < device_side.size(); ++i) pair_of_block.emplace(device_side[i], i);
  c.pairs = device_side.size();
  c.pair_of_id.reserve(ids.size());
  for (const std::int32_t id : ids) {
    const auto it = pair_of_block.find(id);
    if (it == pair_of_block.end()) return std::nullopt;  // not a block this copy moves
    c.pair_of_id.push_back(it->second);
  }
  return c;
}

Result<std::optional<CudaBackend::SummingCopy>, DeviceErrc> CudaBackend::enqueue_summing_copy(
    Lane& lane, Direction dir, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
    std::span<const std::int32_t> ids) {
  std::optional<SummingCopy> c = summing_pairs(dir, plan, ids);
  if (!c) return c;
  const std::size_t words = targets.size() * c->pairs;
  KVTD_TRY(stage_plan(lane, c->plan, targets, words));
  const std::size_t at = sums_offset(c->pairs);
  auto* d_sums = reinterpret_cast<std::uint64_t*>(static_cast<std::byte*>(lane.ids.dev) + at);
  KVTD_TRY(enqueue(lane, c->plan, targets, /*all_layers=*/true, 0, d_sums));
  auto* h_sums = static_cast<std::byte*>(lane.ids.host) + at;
  KVTD_CUDA_TRY(cudaMemcpyAsync(h_sums, d_sums, words * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, lane.stream));
  c->results = reinterpret_cast<const std::uint64_t*>(h_sums);
  return c;
}

Result<std::vector<std::uint64_t>, DeviceErrc> CudaBackend::run_with_checksums(
    Direction dir, const kernels::CopyPlan& plan, std::span<const kernels::CopyTarget> targets,
    std::span<const std::int32_t> ids, bool copy_first) {
  std::vector<std::uint64_t> out(targets.size() * ids.size());
  if (!copy_first && out.empty()) return out;
  Lane& lane = lane_of(dir);
  MutexLock g(lane.mu);
  BusyMark busy(lane);
  KVTD_CUDA_TRY(cudaSetDevice(device_));
  auto st = [&]() REQUIRES(lane.mu) -> Status<DeviceErrc> {
    const std::int64_t enqueued = ipc::monotonic_now_ns();
    std::uint64_t bytes = 0;  // what the wait expects to move (the checksums alone: nothing)
    if (copy_first)
      for (const auto& t : targets) bytes += t.block_bytes * static_cast<std::uint64_t>(plan.num_blocks);
    // Kernel mode sums in the copy's own pass (a separate checksum pass cost full verification
    // 3.6-7.5% on an H100: a second read of every byte, two more launches, another upload).
    if (copy_first && !out.empty() && mode_ == ScatterMode::kKernelAllLayers) {
      KVTD_ASSIGN_OR_RETURN(const auto fused, enqueue_summing_copy(lane, dir, plan, targets, ids));
      if (fused.has_value()) {
        const SummingCopy& c = *fused;
        KVTD_TRY(wait_lane(lane, bytes, enqueued));
        for (std::size_t t = 0; t < targets.size(); ++t)
          for (std::size_t k = 0; k < ids.size(); ++k) out[t * ids.size() + k] = c.results[t * c.pairs + c.pair_of_id[k]];
        return {};
      }
    }
    if (copy_first) {
      KVTD_TRY(stage_plan(lane, plan, targets));
      KVTD_TRY(enqueue(lane, plan, targets, /*all_layers=*/true));
    }
    const std::uint64_t* results = nullptr;
    if (!out.empty()) {
      KVTD_ASSIGN_OR_RETURN(results, enqueue_checksums(lane, dir, targets, ids));
    }
    KVTD_TRY(wait_lane(lane, bytes, enqueued));  // the copy and the sums: one wait
    if (results != nullptr) std::memcpy(out.data(), results, out.size() * sizeof(std::uint64_t));
    return {};
  }();
  // As in copy(): nothing enqueued may still run once we report failure.
  if (!st.ok()) {
    lane.drain();
    return std::move(st).error();
  }
  return out;
}

CudaBackend::BusyMark::BusyMark(Lane& lane) : lane_(lane) {
  lane_.busy_since.store(ipc::monotonic_now_ns(), std::memory_order_release);
}

std::int64_t CudaBackend::busy_since_ns() const {
  std::int64_t oldest = 0;
  for (const auto& lane : lanes_) {
    const std::int64_t t = lane.busy_since.load(std::memory_order_acquire);
    if (t != 0 && (oldest == 0 || t < oldest)) oldest = t;
  }
  return oldest;
}

Status<DeviceErrc> CudaBackend::ensure_events(Lane& lane, std::size_t layers) {
  while (lane.events.size() < layers) {
    cudaEvent_t ev{};
    KVTD_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess));
    lane.events.push_back(ev);
  }
  return {};
}

Status<DeviceErrc> CudaBackend::gather_to_staging(std::span<const kernels::LayerTensor> tensors,
                                     std::span<const std::int32_t> ids, std::byte* staging) {
  return transform(lane_of(Direction::kToHost), tensors, ids, staging, true);
}

Status<DeviceErrc> CudaBackend::scatter_from_staging(std::span<const kernels::LayerTensor> tensors,
                                        std::span<const std::int32_t> ids, const std::byte* staging) {
  return transform(lane_of(Direction::kToDevice), tensors, ids, const_cast<std::byte*>(staging), false);
}

Status<DeviceErrc> CudaBackend::transform(Lane& lane, std::span<const kernels::LayerTensor> tensors,
                             std::span<const std::int32_t> ids, std::byte* staging, bool gather) {
  if (ids.empty() || tensors.empty()) return {};
  MutexLock g(lane.mu);
  BusyMark busy(lane);
  KVTD_CUDA_TRY(cudaSetDevice(device_));
  auto st = transform_locked(lane, tensors, ids, staging, gather);
  if (!st.ok()) lane.drain();
  return st;
}

Status<DeviceErrc> CudaBackend::transform_locked(Lane& lane, std::span<const kernels::LayerTensor> tensors,
                                    std::span<const std::int32_t> ids, std::byte* staging, bool gather) {
  // One object (the storage movers' steady state) names its block by value: no ids upload.
  const bool one = ids.size() == 1;
  if (!one) {
    KVTD_TRY(lane.ids.reserve(ids.size_bytes()));
    std::memcpy(lane.ids.host, ids.data(), ids.size_bytes());
    KVTD_TRY(lane.ids.upload(ids.size_bytes(), lane.stream));
  }
  // The tensors and each one's offset in an object, as one table: the same for every object of a
  // target, so upload_table sends it once.
  std::vector<std::byte> table(tensors.size_bytes() + tensors.size() * sizeof(std::uint64_t));
  std::memcpy(table.data(), tensors.data(), tensors.size_bytes());
  std::uint64_t object = 0, max_block = 0;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    std::memcpy(table.data() + tensors.size_bytes() + t * sizeof(std::uint64_t), &object, sizeof object);
    object += tensors[t].block_bytes;
    max_block = std::max<std::uint64_t>(max_block, tensors[t].block_bytes);
  }
  KVTD_TRY(upload_table(lane, lane.layout_table, table.data(), table.size()));
  static_assert(sizeof(kernels::LayerTensor) % alignof(std::uint64_t) == 0, "the offsets follow the tensors aligned");
  const auto* layout = static_cast<const std::byte*>(lane.layout_table.mirror.dev);
  const auto* d_tensors = reinterpret_cast<const kernels::LayerTensor*>(layout);
  const auto* offsets = reinterpret_cast<const std::uint64_t*>(layout + tensors.size_bytes());
  const auto* d_ids = one ? nullptr : static_cast<const std::int32_t*>(lane.ids.dev);
  const std::int32_t only_id = one ? ids[0] : 0;
  const auto count = static_cast<std::int64_t>(ids.size());
  const auto nt = static_cast<std::uint32_t>(tensors.size());
  if (!host_pointers_) {  // the kernel addresses the mapped staging by its device pointer
    void* mapped = nullptr;
    KVTD_CUDA_TRY(cudaHostGetDevicePointer(&mapped, staging, 0));
    staging = static_cast<std::byte*>(mapped);
  }
  const std::uint32_t parts = pieces(max_block, ids.size() * tensors.size());
  const int e = gather ? kernels::launch_gather_to_staging(d_tensors, offsets, nt, d_ids, count, staging, object,
                                                           lane.stream, parts, only_id)
                       : kernels::launch_scatter_from_staging(d_tensors, offsets, nt, d_ids, count, staging, object,
                                                              lane.stream, parts, only_id);
  if (e != 0) return make_error(errc_of(static_cast<cudaError_t>(e)), cuda_text("layout kernel", static_cast<cudaError_t>(e)));
  KVTD_CUDA_TRY(cudaStreamSynchronize(lane.stream));
  return {};
}

}  // namespace kvtd::daemon::cuda
