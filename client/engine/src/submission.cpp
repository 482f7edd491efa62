// Submission: a request checked and turned into its records, pushed into the ring and recorded
// as pending for the ranks it goes to.
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

namespace {

Status<IpcErrc> check_keys(std::span<const std::string> keys) {
  if (keys.size() > proto::kMaxKeysPerTask)
    return make_error(IpcErrc::kInvalidArgument, std::to_string(keys.size()) + " keys exceed the limit of " +
                                                     std::to_string(proto::kMaxKeysPerTask) + " per task");
  for (std::size_t i = 0; i < keys.size(); ++i)
    if (!valid_engine_key(keys[i]))
      return make_error(IpcErrc::kInvalidArgument, "key " + std::to_string(i) + " ('" + keys[i].substr(0, 40) +
                                                       "') is not 1-" + std::to_string(proto::kMaxKeyBytes) +
                                                       " characters of [A-Za-z0-9_.:-]");
  return {};
}

Encoded encode_storage(proto::TaskKind kind, std::uint16_t flags, const TaskRequest& req,
                       std::span<const std::string> keys, std::span<const std::int32_t> blocks,
                       std::uint64_t weight_version) {
  Encoded e;
  e.hdr.kind = static_cast<std::uint16_t>(kind);
  e.hdr.flags = flags;
  e.hdr.format_version = proto::kTaskFormatVersion;
  e.hdr.deadline_ns = req.deadline_ns;
  e.hdr.after_task_id = req.after_task_id;
  e.hdr.num_keys = static_cast<std::uint32_t>(keys.size());
  proto::StorageTaskArgs args{};
  args.weight_version = weight_version;
  args.cancel_task_id = req.cancel_task_id;
  args.min_hits = req.min_hits;
  e.src = encode_storage_section(args, keys);
  e.dst.assign(blocks.begin(), blocks.end());
  return e;
}

// A swap's record, and its backup STORAGE_WRITE when it carries keys.
Result<std::vector<Encoded>, IpcErrc> encode_swap(const TaskRequest& req, std::uint64_t weight_version,
                                                  std::uint32_t groups) {
  using proto::TaskKind;
  std::vector<Encoded> out;
  const auto kind = req.kind;
  Encoded e;
  e.hdr.kind = static_cast<std::uint16_t>(kind);
  e.hdr.format_version = proto::kTaskFormatVersion;
  e.hdr.after_task_id = req.after_task_id;
  e.hdr.deadline_ns = req.deadline_ns;
  if (req.layerwise) {
    if (kind != TaskKind::kSwapToDevice)
      return make_error(IpcErrc::kInvalidArgument, "layer-by-layer is only for SWAP_TO_DEVICE tasks");
    e.hdr.flags = proto::kTaskFlagLayerwise;
  }
  e.src.assign(req.src.begin(), req.src.end());
  e.dst.assign(req.dst.begin(), req.dst.end());
  for (const auto& ev : req.engine_events) {
    const auto* b = reinterpret_cast<const std::byte*>(ev.data());
    e.events.insert(e.events.end(), b, b + ev.size());
  }
  if (!req.keys.empty()) e.hdr.flags |= proto::kTaskFlagBackupPair;
  out.push_back(std::move(e));
  if (!req.keys.empty()) {
    if (kind != TaskKind::kSwapToHost)
      return make_error(IpcErrc::kInvalidArgument, "keys on a swap are only for SWAP_TO_HOST (its backup)");
    if (groups != 0)
      return make_error(IpcErrc::kInvalidArgument,
                        "keys on a swap: a session of cache groups backs up with a STORAGE_WRITE of its own (a "
                        "block per key and group)");
    if (req.keys.size() != req.dst.size())
      return make_error(IpcErrc::kInvalidArgument, std::to_string(req.keys.size()) + " keys for " +
                                                       std::to_string(req.dst.size()) + " destination host blocks");
    KVTD_TRY(check_keys(req.keys));
    TaskRequest backup = req;
    backup.after_task_id = 0;  // set to the swap's id as both are pushed: stored only if it went ok
    out.push_back(encode_storage(TaskKind::kStorageWrite,
                                 proto::kTaskFlagHostBlocks | proto::kTaskFlagPolicyBackup |
                                     proto::kTaskFlagBackupPair,
                                 backup, req.keys, req.dst, weight_version));
    out.back().after_first_record = true;
  }
  return out;
}

// Turns a request into the records it submits (a swap with keys adds its backup), or an error.
// `groups`: the session's cache groups (0: a single shape); their storage tasks name a block per
// key and group, group-major, -1 where a group has none.
Result<std::vector<Encoded>, IpcErrc> encode_request(const TaskRequest& req, std::uint64_t weight_version,
                                                     std::uint32_t groups) {
  using proto::TaskKind;
  std::vector<Encoded> out;
  const auto kind = req.kind;
  if (kind == TaskKind::kSwapToHost || kind == TaskKind::kSwapToDevice) return encode_swap(req, weight_version, groups);
  if (proto::is_cache_control_kind(kind))
    return make_error(IpcErrc::kInvalidArgument, std::string(proto::task_kind_name(kind)) +
                                                     " is submitted by clear_caches() / restore_caches()");
  if (!proto::is_storage_kind(kind))
    return make_error(IpcErrc::kInvalidArgument, "task kind " + std::to_string(static_cast<unsigned>(kind)) +
                                                     " is reserved or unknown");
  if (req.layerwise) return make_error(IpcErrc::kInvalidArgument, "layer-by-layer is only for SWAP_TO_DEVICE tasks");
  if (!req.src.empty() || !req.dst.empty())
    return make_error(IpcErrc::kInvalidArgument, std::string(proto::task_kind_name(kind)) +
                                                     " takes keys and blocks, not src/dst");
  KVTD_TRY(check_keys(req.keys));
  std::uint16_t flags = req.host_blocks ? proto::kTaskFlagHostBlocks : 0;
  switch (kind) {
    case TaskKind::kStorageQuery:
      if (!req.blocks.empty()) return make_error(IpcErrc::kInvalidArgument, "STORAGE_QUERY takes keys only");
      flags = 0;
      break;
    case TaskKind::kCancel:
      if (!req.keys.empty() || !req.blocks.empty() || req.cancel_task_id == 0)
        return make_error(IpcErrc::kInvalidArgument, "CANCEL takes only cancel_task_id (non-zero)");
      flags = 0;
      break;
    case TaskKind::kPrefetch:
      if (!req.host_blocks) return make_error(IpcErrc::kInvalidArgument, "PREFETCH loads into host blocks only");
      [[fallthrough]];
    default:
      if (req.keys.size() * std::max<std::uint32_t>(groups, 1) != req.blocks.size())
        return make_error(IpcErrc::kInvalidArgument,
                          std::to_string(req.keys.size()) + " keys for " + std::to_string(req.blocks.size()) +
                              " blocks" +
                              (groups == 0 ? std::string()
                                           : " (a session of " + std::to_string(groups) +
                                                 " cache groups names a block per key and group, group-major)"));
      if (req.evict_backup) {
        if (kind != TaskKind::kStorageWrite || !req.host_blocks)
          return make_error(IpcErrc::kInvalidArgument, "evict_backup is for STORAGE_WRITE of host blocks");
        flags |= proto::kTaskFlagEvictBackup;
      }
  }
  out.push_back(encode_storage(kind, flags, req, req.keys, req.blocks, weight_version));
  if (kind == TaskKind::kCancel) out.back().cancels = req.cancel_task_id;
  return out;
}

}  // namespace

Result<std::uint64_t, IpcErrc> EngineSession::submit(const TaskRequest& req) {
  const Impl::Gate gate(impl_.get());
  KVTD_TRY(gate.check());
  const bool swap = req.kind == proto::TaskKind::kSwapToHost || req.kind == proto::TaskKind::kSwapToDevice;
  if (!req.engine_events.empty() && (!swap || req.engine_events.size() != impl_->geo.num_ranks))
    return make_error(IpcErrc::kInvalidArgument,
                      swap ? std::to_string(req.engine_events.size()) + " engine events for " +
                                 std::to_string(impl_->geo.num_ranks) + " ranks (one per rank, in rank order)"
                           : std::string("engine events are for swap tasks; ") + proto::task_kind_name(req.kind) +
                                 " takes none");
  KVTD_ASSIGN_OR_RETURN(auto encoded, encode_request(req, impl_->weight_version.load(), groups().num_groups));
  return impl_->submit_encoded(encoded, req.submit_timeout_ns, false);
}

// Cache-control tasks (CLEAR_CACHE / RESTORE_CACHE) go to the ranks attached now: one that is
// not attached maps nothing, and reads the cache state after its grant. Every other task is
// refused while the cache is cleared and needs every rank attached.
Result<std::uint64_t, IpcErrc> EngineSession::Impl::submit_encoded(std::vector<Encoded>& records,
                                                                   std::int64_t timeout_ns, bool cache_control) {
  auto* impl = this;
  std::uint64_t need = 0;
  for (const auto& e : records)
    need += proto::task_record_bytes(static_cast<std::uint32_t>(e.src.size()), static_cast<std::uint32_t>(e.dst.size()),
                                     static_cast<std::uint32_t>(e.events.size() / proto::kEngineEventBytes));
  for (const auto& e : records)
    // fits() keeps one record within half the ring (room for wrap padding); a swap and its backup
    // go in together, so they must fit there together.
    if (!impl->ring->fits(e.src.size(), e.dst.size(), e.events.size()) ||
        (records.size() > 1 && need > impl->view.layout.ring_bytes / 2))
      return make_error(IpcErrc::kTooLarge, "a task of " + std::to_string(need) + " bytes (" +
                                                std::to_string(e.src.size() + e.dst.size()) +
                                                " words) cannot fit in a " +
                                                std::to_string(impl->view.layout.ring_bytes) + "-byte task ring");
  const std::int64_t deadline = deadline_after(impl->clock->now_ns(), timeout_ns);
  for (;;) {
    if (closing.load(std::memory_order_seq_cst)) return closing_error();
    const std::uint32_t space_seen = h->space_word.load(std::memory_order_acquire);
    const std::uint32_t done_seen = h->completion_word.load(std::memory_order_acquire);
    bool wait_space = false;
    {
      MutexLock g(impl->mu);
      impl->service(false);
      std::uint32_t expected = 0;
      if (!cache_control && impl->cache.cleared())
        return make_error(IpcErrc::kCacheCleared, "the KV cache of session " + impl->name +
                                                      " is cleared for a weight update: restore_caches() first");
      for (std::uint32_t r = 0; r < impl->geo.num_ranks; ++r) {
        if (!impl->serves(r)) continue;
        if (cache_control) {
          if (auto refusal = impl->roster.cache_control_refusal(r); !refusal.empty())
            return make_error(IpcErrc::kNotReady, std::move(refusal));
        }
        if (h->ranks[r].attached.load(std::memory_order_acquire)) expected |= 1u << r;
        else if (!cache_control)
          return make_error(IpcErrc::kNotReady, "rank " + std::to_string(r) + " is not attached to session " + impl->name);
      }
      if (expected == 0) return std::uint64_t{0};  // cache control with no rank attached: nothing to tell
      if (impl->merger.pending_count() + records.size() <= impl->opts.completion_capacity) {
        // All records of a request go in together (a swap and its backup get consecutive ids):
        // with 2 x need free, padding before a wrap (less than one record) cannot starve the second.
        if (records.size() == 1 || impl->ring->free_bytes() >= 2 * need) {
          std::uint64_t first = 0;
          bool pushed = true;
          for (std::size_t i = 0; i < records.size() && pushed; ++i) {
            if (records[i].after_first_record) records[i].hdr.after_task_id = first;
            auto id = impl->push_locked(records[i].hdr, records[i].src, records[i].dst, expected, records[i].events,
                                        records[i].cancels);
            pushed = id.has_value();
            if (pushed && i == 0) first = *id;
          }
          if (pushed) return first;
          if (records.size() > 1) return make_error(IpcErrc::kSystem, "task ring refused a record it had room for");
        }
        wait_space = true;
      }
      const std::int64_t now = impl->clock->now_ns();
      if (now >= deadline) {
        if (wait_space)
          return make_error(IpcErrc::kRingFull, "task ring full: " + std::to_string(impl->ring->free_bytes()) +
                                                    " bytes free, task needs " + std::to_string(need) +
                                                    "; ranks did not consume within " +
                                                    std::to_string(timeout_ns / 1'000'000) + " ms");
        return make_error(IpcErrc::kTooManyInFlight, std::to_string(impl->merger.pending_count()) +
                                                         " tasks in flight, the completion capacity");
      }
    }
    const std::int64_t slice = std::min(deadline, monotonic_now_ns() + impl->opts.service_period_ns);
    if (wait_space)
      (void)wait_on_word(h->space_word, space_seen, slice, &h->producer_waiters, 5'000);
    else
      (void)wait_on_word(h->completion_word, done_seen, slice, &h->completion_waiters, 5'000);
  }
}

std::optional<std::uint64_t> EngineSession::Impl::push_locked(proto::TaskRecordHeader hdr, std::span<const std::int32_t> src,
                                         std::span<const std::int32_t> dst, std::uint32_t expected,
                                         std::span<const std::byte> events, std::uint64_t cancels) {
  hdr.task_id = next_task_id;
  hdr.submit_ns = clock->now_ns();
  std::uint64_t seq = 0;
  if (!ring->try_push(hdr, src, dst, &seq, events)) return std::nullopt;
  ++next_task_id;
  merger.expect(hdr.task_id, seq, expected != 0 ? expected : all_ranks_mask(), hdr.submit_ns, cancels);
  const auto kind = static_cast<proto::TaskKind>(hdr.kind);
  if (opts.completion_forecast) swaps.submitted(hdr.task_id, kind, src.size(), hdr.submit_ns);
  bump_and_wake(h->publish_word, &h->consumer_waiters);
  return hdr.task_id;
}

}  // namespace kvtd::engine
