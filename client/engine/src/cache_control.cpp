// Weight updates: clear_caches / restore_caches, and the registry state they gate.
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

bool EngineSession::Impl::registry_writable() const {
  return h->state.load() == static_cast<std::uint32_t>(proto::SessionState::kCreating) ||
         cache.confirmed();
}

Status<IpcErrc> EngineSession::Impl::registry_complete() const {
  const auto* reg = view.registry();
  bool any = false;
  for (std::uint64_t i = 0; i < view.layout.registry_count; ++i) any = any || reg[i].valid != 0;
  if (!any) return {};
  for (std::uint32_t r = 0; r < geo.num_ranks; ++r) {
    if (!serves(r)) continue;  // another process's session registers that rank's tensors
    for (const auto [l, kind] : proto::tensors_of(geo))
      if (!reg[proto::registry_index(geo, r, l, kind)].valid)
        return make_error(IpcErrc::kInvalidArgument, std::string("tensor ") + proto::tensor_kind_name(kind) +
                                                         " of rank " + std::to_string(r) + " layer " +
                                                         std::to_string(l) + " is not registered");
  }
  return {};
}

void EngineSession::Impl::set_cache_state(bool cleared) {
  cache.set(cleared);
  h->cache_state.store(static_cast<std::uint32_t>(cleared ? proto::CacheState::kCleared : proto::CacheState::kLive),
                       std::memory_order_release);
}

// Submits one cache-control task and waits for its merged result. Ok when every rank that got
// it reported ok, or left for good (kRankDead: fenced or detached in order, so it maps nothing).
Result<TaskResult, IpcErrc> EngineSession::Impl::run_cache_control(proto::TaskKind kind, std::uint16_t flags,
                                                                  std::int64_t timeout_ns) {
  std::vector<Encoded> records(1);
  records[0].hdr.kind = static_cast<std::uint16_t>(kind);
  records[0].hdr.flags = flags;
  records[0].hdr.format_version = proto::kTaskFormatVersion;
  const std::int64_t deadline = deadline_after(clock->now_ns(), timeout_ns);
  KVTD_ASSIGN_OR_RETURN(const std::uint64_t id, submit_encoded(records, timeout_ns, true));
  if (id == 0) return TaskResult{};  // no rank attached
  std::int64_t left = deadline - clock->now_ns();
  KVTD_ASSIGN_OR_RETURN(TaskResult r, wait_result(id, left > 0 ? left : 0));
  for (const auto& f : r.failures)
    if (f.status != TaskStatus::kRankDead)
      return make_error(IpcErrc::kTaskFailed, std::string(proto::task_kind_name(kind)) + " failed on rank " +
                                                  std::to_string(f.rank) + ": " + proto::task_status_name(f.status) +
                                                  ": " + f.message);
  return r;
}

Result<TaskResult, IpcErrc> EngineSession::clear_caches(const ClearOptions& options) {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  auto* impl = impl_.get();
  {
    MutexLock g(impl->mu);
    if (impl->h->state.load() != static_cast<std::uint32_t>(proto::SessionState::kReady))
      return make_error(IpcErrc::kInvalidArgument, "clear_caches() needs a published session");
    impl->set_cache_state(true);
  }
  auto r = impl->run_cache_control(proto::TaskKind::kClearCache,
                                   options.drop_host_tier ? proto::kTaskFlagDropHostTier : 0, options.timeout_ns);
  // On failure the cache stays cleared but unconfirmed: tasks are refused, tensors must not be
  // freed; clear again (or restore) once the cause is fixed.
  if (!r.ok()) return r;
  if (options.weight_version) impl->weight_version.store(*options.weight_version);
  MutexLock g(impl->mu);
  impl->cache.confirm();  // unless a restore raced us
  return r;
}

Result<TaskResult, IpcErrc> EngineSession::restore_caches(std::int64_t timeout_ns) {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  auto* impl = impl_.get();
  {
    MutexLock g(impl->mu);
    if (!impl->cache.cleared()) return make_error(IpcErrc::kInvalidArgument, "the cache is not cleared: nothing to restore");
    KVTD_TRY(impl->registry_complete());
    // Live in the header before RESTORE_CACHE is in the ring: a rank granted from now on maps
    // the new registry itself. Tasks stay refused here until RESTORE_CACHE is submitted, so none
    // lands in the ring before it.
    impl->h->cache_state.store(static_cast<std::uint32_t>(proto::CacheState::kLive), std::memory_order_release);
    impl->cache.restore_begins();
  }
  std::vector<Encoded> records(1);
  records[0].hdr.kind = static_cast<std::uint16_t>(proto::TaskKind::kRestoreCache);
  records[0].hdr.format_version = proto::kTaskFormatVersion;
  const std::int64_t deadline = deadline_after(impl->clock->now_ns(), timeout_ns);
  auto id = impl->submit_encoded(records, timeout_ns, true);
  {
    MutexLock g(impl->mu);
    impl->set_cache_state(!id.ok());
  }
  if (!id.ok()) return std::move(id).error();
  if (*id == 0) return TaskResult{};
  const std::int64_t left = deadline - impl->clock->now_ns();
  auto r = impl->wait_result(*id, left > 0 ? left : 0);
  std::string why;
  if (!r.ok()) {
    why = r.error().message;
  } else {
    for (const auto& f : r->failures)
      if (f.status != TaskStatus::kRankDead && why.empty())
        why = "RESTORE_CACHE failed on rank " + std::to_string(f.rank) + ": " + proto::task_status_name(f.status) +
              ": " + f.message;
  }
  if (why.empty()) return r;
  // A rank that could not re-open fails every task (cache_cleared): back to cleared, so the
  // engine refuses tasks instead; clear_caches() then restore_caches() again after fixing it.
  MutexLock g(impl->mu);
  impl->set_cache_state(true);
  return make_error(r.ok() ? IpcErrc::kTaskFailed : r.error().code,
                    why + "; the cache stays cleared: clear_caches() and restore_caches() again");
}

bool EngineSession::cache_cleared() const {
  MutexLock g(impl_->mu);
  return impl_->cache.cleared();
}

}  // namespace kvtd::engine
