// Layer-by-layer loads: waiting for one layer of a task, and the per-layer CUDA event handles.
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "kvtd/ipc/populate.h"
#include "kvtd/ipc/process.h"
#include "kvtd/ipc/task_codec.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/proto/names.h"
#include "session_impl.h"

namespace kvtd::engine {

Status<IpcErrc> EngineSession::wait_layer(std::uint64_t task_id, std::uint32_t layer, std::int64_t timeout_ns,
                                          LayerStage stage) {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  auto* impl = impl_.get();
  auto* h = impl->h;
  if (layer >= impl->geo.num_layers)
    return make_error(IpcErrc::kInvalidArgument, "layer " + std::to_string(layer) + " is out of range: the session has " +
                                                     std::to_string(impl->geo.num_layers) + " layers");
  const std::int64_t deadline = deadline_after(impl->clock->now_ns(), timeout_ns);
  for (;;) {
    if (impl->closing.load(std::memory_order_seq_cst)) return impl->closing_error();
    const std::uint32_t progress_seen = h->progress_word.load(std::memory_order_acquire);
    const std::uint32_t done_seen = h->completion_word.load(std::memory_order_acquire);
    {
      MutexLock g(impl->mu);
      impl->service(false);
      if (const TaskResult* done = impl->merger.peek(task_id)) {
        if (done->ok()) return {};
        const auto& f = done->failures.front();
        return make_error(IpcErrc::kTaskFailed, "task " + std::to_string(task_id) + " failed on rank " +
                                                    std::to_string(f.rank) + ": " + f.message);
      }
      const auto seq = impl->merger.seq_of(task_id);
      if (!seq) return make_error(IpcErrc::kUnknownTask, "task " + std::to_string(task_id) + " is not pending");
      const std::uint32_t reported = impl->merger.reported(task_id);
      bool all = true;
      for (std::uint32_t r = 0; r < impl->geo.num_ranks && all; ++r) {
        if (!impl->serves(r) || (reported & (1u << r))) continue;  // not ours, or finished the whole task
        auto* slot = impl->view.progress_slot(r, *seq);
        const std::uint64_t before = slot->task_id.load(std::memory_order_acquire);
        const std::uint32_t reached = stage == LayerStage::kDone ? slot->layers_done.load(std::memory_order_acquire)
                                                                 : slot->layers_enqueued.load(std::memory_order_acquire);
        const std::uint64_t after = slot->task_id.load(std::memory_order_acquire);
        all = before == task_id && after == task_id && reached > layer;
      }
      if (all) return {};
    }
    const std::int64_t now = impl->clock->now_ns();
    if (now >= deadline)
      return make_error(IpcErrc::kTimeout, "layer " + std::to_string(layer) + " of task " + std::to_string(task_id) +
                                               " not complete after " + std::to_string(timeout_ns / 1'000'000) + " ms");
    const std::int64_t slice = std::min(deadline, monotonic_now_ns() + impl->opts.service_period_ns);
    // Progress and completions both end this wait; watch progress, re-check completions per slice.
    if (h->completion_word.load(std::memory_order_acquire) == done_seen)
      (void)wait_on_word(h->progress_word, progress_seen, slice, &h->progress_waiters);
  }
}

std::optional<std::array<std::uint8_t, proto::kHandleBytes>> EngineSession::layer_event_handle(
    std::uint32_t rank, std::uint32_t layer, std::uint32_t* epoch_out) const {
  const Impl::Gate gate(impl_.get());
  if (!gate.usable()) return std::nullopt;
  const auto& v = impl_->view;
  if (rank >= impl_->geo.num_ranks || layer >= impl_->geo.num_layers) return std::nullopt;
  auto* control = v.progress_control(rank);
  const auto& slot = impl_->h->ranks[rank];
  // Acquire pairs with the rank's release of events_published: the handle words are complete.
  const std::uint32_t n = control->events_published.load(std::memory_order_acquire);
  const std::uint32_t epoch = control->events_epoch.load(std::memory_order_relaxed);
  if (n <= layer) return std::nullopt;
  // Only the live daemon's events: one exported by a process that has since died is undefined
  // behaviour to open.
  if (!slot.attached.load(std::memory_order_acquire) || slot.attached_epoch.load(std::memory_order_acquire) != epoch)
    return std::nullopt;
  std::array<std::uint8_t, proto::kHandleBytes> out{};
  auto* words = reinterpret_cast<std::uint64_t*>(v.event_handle(rank, layer));
  // Acquire on every word (no fence: TSan cannot model one): the re-check below cannot move
  // before any of these loads.
  for (std::size_t w = 0; w < proto::kHandleBytes / 8; ++w) {
    const std::uint64_t x = std::atomic_ref<std::uint64_t>(words[w]).load(std::memory_order_acquire);
    std::memcpy(out.data() + 8 * w, &x, 8);
  }
  // Overwritten while we copied (a restarted daemon): not a handle of any one exporter.
  if (control->events_published.load(std::memory_order_relaxed) != n ||
      control->events_epoch.load(std::memory_order_relaxed) != epoch)
    return std::nullopt;
  if (epoch_out != nullptr) *epoch_out = epoch;
  return out;
}

}  // namespace kvtd::engine
