#include "kvtd/base/mutex.h"
#include "kvtd/daemon/storage_executor.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>
#include <numeric>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/storage/object_format.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::daemon {

using proto::TaskKind;
using proto::TaskStatus;

std::uint64_t layout_fingerprint(const proto::CacheGeometry& g) {
  // Only what shapes an object's bytes; fixed-width fields hashed in a fixed order.
  // f[3] was a constant 2 before scale sizes varied and f[10] was 0 before extra layers: the
  // fingerprint of every earlier geometry is unchanged, so what was stored stays readable.
  std::uint64_t f[12] = {g.dtype, g.num_layers, g.num_ranks, g.has_scales() ? g.scale_element_bytes() : 2u};
  f[10] = g.num_extra_layers;
  for (int i = 1; i < 4; ++i) {
    f[3 + i] = static_cast<std::uint64_t>(g.key_shape[i]);
    f[6 + i] = static_cast<std::uint64_t>(g.value_shape[i]);
  }
  f[11] = 0x6b767464u;  // "kvtd": a version of this recipe
  return storage::hash_bytes(f, sizeof f);
}

std::string staging_problem(const config::StorageConfig& c, std::uint64_t object_bytes) {
  const std::uint64_t per_worker = (c.staging_mib << 20) / c.io_threads;
  if (object_bytes != 0 && per_worker >= object_bytes) return "";
  return "--storage-staging-mib " + std::to_string(c.staging_mib) + " over " + std::to_string(c.io_threads) +
         " --storage-io-threads gives each worker " + std::to_string(per_worker) +
         " bytes, less than one stored object (" + std::to_string(object_bytes) +
         " bytes: one block, every layer); raise the staging or lower the threads";
}

namespace {

// The most objects one per-key use count map holds before it starts over (bounds memory).
constexpr std::size_t kMaxCountedKeys = 1u << 20;

// "write /long/path/x.kvo: No space left on device" -> "No space left on device (write /long/...)".
std::string cause_of(const std::string& error) {
  const auto at = error.rfind(": ");
  if (at == std::string::npos) return error;
  return error.substr(at + 2) + " (" + error.substr(0, at) + ")";
}

}  // namespace

// A task through phase 1: the keys it stores or loads, their blocks, the agreed count.
struct Prepared {
  StorageWork work;
  std::int64_t start = 0;
  std::vector<std::size_t> which;   // indices into work.section.keys that take part
  std::vector<std::string> stored;  // their stored names
  std::vector<std::int32_t> ids;    // their blocks
  std::uint32_t agreed = 0;
};

struct StorageExecutor::Impl {
  endpoint::RankEndpoint& ep;
  DeviceBackend& backend;
  HostPool* pool;
  StorageTargets t;
  Complete complete;
  Release release;
  std::size_t chunk_objects = 0;   // objects per worker staging slice
  std::vector<std::byte*> staging;  // one slice per worker
  std::vector<HostBuffer> staging_memory;  // owns the slices: returned when the executor ends

  // The queues and the task sets. Never held across I/O, a wait or another of these mutexes.
  Mutex mu;
  // Workers sleep on this word (spin, then futex): a condition variable's wake-up alone cost
  // tens of microseconds per task, more than a whole swap round trip.
  // One word per queue, so a new task wakes only the thread that takes it: waking the workers on
  // every agreement cost several microseconds of a 2-core round trip.
  struct Wake {
    std::atomic<std::uint32_t> word{0};
    std::atomic<std::uint32_t> waiters{0};
    void bump() { ipc::bump_and_wake(word, &waiters); }
  };
  Wake agree_wake, work_wake;
  std::deque<StorageWork> agreeing GUARDED_BY(mu);  // phase 1, ring order
  std::deque<Prepared> high GUARDED_BY(mu);         // phase 2: loads first,
  std::deque<Prepared> low GUARDED_BY(mu);          // then writes
  bool agree_done GUARDED_BY(mu) = false;           // the agreement thread has exited (after closing)
  std::unordered_set<std::uint64_t> live GUARDED_BY(mu);       // queued or running task ids
  std::unordered_set<std::uint64_t> cancelled GUARDED_BY(mu);  // subset of live
  std::unordered_set<std::uint64_t> committed GUARDED_BY(mu);  // subset of live: past their last cancel check
  bool closing GUARDED_BY(mu) = false;
  std::vector<std::thread> workers;
  std::thread agreement;

  Mutex prefix_mu;  // the RL key prefix cache (agreement thread; any thread)
  bool prefix_known GUARDED_BY(prefix_mu) = false;
  std::uint64_t prefix_wv GUARDED_BY(prefix_mu) = 0;
  std::string current_prefix GUARDED_BY(prefix_mu);

  Mutex count_mu;
  std::unordered_map<std::string, std::uint32_t> uses GUARDED_BY(count_mu);  // write_through_selective

  mutable Mutex stats_mu;
  StorageStats st GUARDED_BY(stats_mu);

  Impl(endpoint::RankEndpoint& e, DeviceBackend& b, HostPool* p, StorageTargets targets, Complete c, Release r)
      : ep(e), backend(b), pool(p), t(std::move(targets)), complete(std::move(c)), release(std::move(r)) {}

  // FastDeploy's RL key prefix for tasks of the engine's weight version `wv`: read from
  // version.yaml again when the version changes (the engine changes it at FastDeploy's sync
  // points only, so a version.yaml the trainer rewrites mid-serving is not picked up early).
  // An unreadable file fails the task: a guessed prefix could load KV of other weights.
  Result<std::string, config::ConfigErrc> key_prefix_for(std::uint64_t wv) {
    if (t.config.key_prefix_source.empty()) return t.config.key_prefix;
    MutexLock g(prefix_mu);
    if (prefix_known && wv == prefix_wv) return current_prefix;
    auto p = config::fastdeploy_key_prefix(t.config.key_prefix_source);
    if (!p.ok()) return std::move(p).error();
    if (!prefix_known || *p != current_prefix)
      KVTD_INFO("storage key prefix '{}' (weight version {}, from {}/version.yaml)", *p, wv, t.config.key_prefix_source);
    current_prefix = *p;
    prefix_wv = wv;
    prefix_known = true;
    return current_prefix;
  }

  std::string stored_key(const std::string& key, const std::string& key_prefix, std::uint64_t task_weight_version) const {
    const std::uint32_t slice_rank = t.replicated ? 0 : ep.rank();
    // FastDeploy's RL prefix (from version.yaml) joins the weight version: KV of other weights
    // is never found.
    const std::string prefix = key_prefix.empty() ? "" : "." + key_prefix;
    return key + prefix + ".w" + std::to_string(t.config.weight_version) + "-" + std::to_string(task_weight_version) + ".r" +
           std::to_string(slice_rank);
  }

  bool is_cancelled(std::uint64_t id) {
    MutexLock g(mu);
    return cancelled.count(id) != 0;
  }

  // A task's objects move in steps of at most ~4 MiB (one object when objects are larger, and
  // at least one per I/O thread so a step keeps them busy), with a cancellation check between
  // steps: a CANCEL stops a write of thousands of small objects promptly.
  std::size_t cancel_step() const {
    constexpr std::uint64_t kStepBytes = 4ull << 20;
    const std::uint64_t by_bytes = t.object_bytes == 0 ? 1 : std::max<std::uint64_t>(1, kStepBytes / t.object_bytes);
    const std::uint64_t step = std::max<std::uint64_t>(by_bytes, t.config.io_threads);
    return static_cast<std::size_t>(std::max<std::uint64_t>(1, std::min<std::uint64_t>(step, chunk_objects)));
  }

  // Checks for a CANCEL before a step; before the last one, also marks the task committed, so
  // a CANCEL that arrives later answers that it will not stop it (it is truthful: a task that
  // CANCEL said would stop never completes ok). True: go on.
  bool may_continue(std::uint64_t id, bool last_step) {
    MutexLock g(mu);
    if (cancelled.count(id) != 0) return false;
    if (last_step) committed.insert(id);
    return true;
  }

  // Why this rank's work must stop without a completion: the engine revoked its epoch.
  bool revoked(const StorageWork& w) const { return w.epoch != ep.epoch() || !ep.granted(); }

  void count_uses(const std::vector<std::string>& keys) {
    MutexLock g(count_mu);
    if (uses.size() + keys.size() > kMaxCountedKeys) uses.clear();
    for (const auto& k : keys) ++uses[k];
  }

  // The cause first, the store (whose name may hold a long path) last: completion messages are
  // cut at 167 characters.
  std::string unavailable(const std::string& what) const { return what + " (" + t.store_name + ")"; }

  void finish(const StorageWork& w, TaskStatus s, std::uint64_t blocks, std::uint64_t skipped, std::int64_t start,
              const std::string& msg) {
    complete(w.header, s, blocks, skipped, start, msg);
  }

  // Fails a task that has not agreed yet: the peers stop waiting at once.
  void fail_before_agreement(const StorageWork& w, TaskStatus s, std::int64_t start, const std::string& msg) {
    ep.abort_agreement(w.header.seq, s);
    ep.leave_agreements(w.header.seq + 1);  // the agreement thread runs tasks in ring order
    finish(w, s, 0, 0, start, msg);
  }

  // The leading stored count of `keys` on this rank, agreed across ranks. On failure the task
  // has been completed (or dropped) and nullopt is returned.
  std::optional<std::uint32_t> local_then_agree(const StorageWork& w, const std::vector<std::string>& keys,
                                                std::int64_t start) {
    auto local = t.store->exists(keys);
    if (!local.ok()) {
      const auto code = local.error().code;
      fail_before_agreement(w, code == storage::StorageErrc::kUnavailable ? TaskStatus::kStorageUnavailable
                                                                          : TaskStatus::kStorageError,
                            start, unavailable(local.error().message));
      return std::nullopt;
    }
    auto agreed = ep.agree(w.header.seq, static_cast<std::uint32_t>(*local), w.header.deadline_ns);
    if (!agreed.ok()) {
      if (revoked(w)) return std::nullopt;  // the engine failed it already
      finish(w, agreed.error().code, 0, 0, start, agreed.error().message);
      return std::nullopt;
    }
    return *agreed;
  }

  // ---- Phase 1, on the agreement thread, in ring order: checks, local count, agreement. ----

  // Which keys a write stores, by its flags and the write policy; the rest count as skipped.
  std::vector<std::size_t> selected_by_policy(const StorageWork& w) {
    const auto policy = t.config.write_policy;
    const auto& keys = w.section.keys;
    std::vector<std::size_t> which;
    if (w.header.flags & proto::kTaskFlagEvictBackup) {
      if (policy != config::WritePolicy::kWriteBack) return which;
    } else if (w.header.flags & proto::kTaskFlagPolicyBackup) {
      count_uses(keys);
      if (policy == config::WritePolicy::kNone || policy == config::WritePolicy::kWriteBack) return which;
      if (policy == config::WritePolicy::kWriteThroughSelective) {
        MutexLock g(count_mu);
        for (std::size_t i = 0; i < keys.size(); ++i) {
          auto it = uses.find(keys[i]);
          if (it != uses.end() && it->second >= t.config.write_threshold) which.push_back(i);
        }
        return which;
      }
    }
    for (std::size_t i = 0; i < keys.size(); ++i) which.push_back(i);
    return which;
  }

  // Runs phase 1 of `p`. Returns true when p must go on to phase 2 (a load or a write with
  // something to move); otherwise the task has been completed (or dropped, revoked).
  bool agree_phase(Prepared& p) {
    const auto& w = p.work;
    p.start = ipc::monotonic_now_ns();
    const auto kind = static_cast<TaskKind>(w.header.kind);
    {
      MutexLock g(stats_mu);
      ++st.tasks;
    }
    if (revoked(w)) return false;
    if (w.header.deadline_ns != 0 && p.start > w.header.deadline_ns) {
      fail_before_agreement(w, TaskStatus::kDeadlineExceeded, p.start,
                            "deadline passed " + std::to_string((p.start - w.header.deadline_ns) / 1000) +
                                " us before execution");
      return false;
    }
    if (is_cancelled(w.header.task_id)) {
      fail_before_agreement(w, TaskStatus::kCancelled, p.start, "cancelled before it started");
      return false;
    }
    const bool backup = (w.header.flags & (proto::kTaskFlagPolicyBackup | proto::kTaskFlagEvictBackup)) != 0;
    if (t.store == nullptr) {
      if (backup) {
        // No storage tier here: nothing to back up to, not an error on this rank. The peers are
        // told (they do have a store, or they would not wait): a mismatch is their failure.
        ep.abort_agreement(w.header.seq, TaskStatus::kStorageUnavailable);
        ep.leave_agreements(w.header.seq + 1);
        finish(w, TaskStatus::kOk, 0, w.section.keys.size(), p.start, "");
        return false;
      }
      fail_before_agreement(w, TaskStatus::kStorageUnavailable, p.start, t.no_store_reason);
      return false;
    }
    std::vector<std::size_t> which;
    if (kind == TaskKind::kStorageWrite) {
      which = selected_by_policy(w);
    } else {
      count_uses(w.section.keys);
      which.resize(w.section.keys.size());
      std::iota(which.begin(), which.end(), std::size_t{0});
    }
    auto key_prefix = key_prefix_for(w.section.args.weight_version);
    if (!key_prefix.ok()) {
      fail_before_agreement(w, TaskStatus::kStorageUnavailable, p.start, "storage key prefix: " + key_prefix.error().message);
      return false;
    }
    for (auto i : which) {
      p.stored.push_back(stored_key(w.section.keys[i], *key_prefix, w.section.args.weight_version));
      if (!w.blocks.empty()) p.ids.push_back(w.blocks[i]);
    }
    p.which = std::move(which);
    auto agreed = local_then_agree(w, p.stored, p.start);
    if (!agreed) return false;
    p.agreed = *agreed;
    switch (kind) {
      case TaskKind::kStorageQuery:
        finish(w, TaskStatus::kOk, p.agreed, 0, p.start, "");
        return false;
      case TaskKind::kPrefetch:
        if (p.agreed < w.section.args.min_hits) {
          finish(w, TaskStatus::kOk, 0, 0, p.start, "");  // revoked: fewer hits than asked for, nothing kept
          return false;
        }
        [[fallthrough]];
      case TaskKind::kStorageRead:
        if (p.agreed == 0) {
          finish(w, TaskStatus::kOk, 0, 0, p.start, "");
          return false;
        }
        return true;
      case TaskKind::kStorageWrite:
        if (p.agreed == p.stored.size()) {
          finish(w, TaskStatus::kOk, 0, w.section.keys.size(), p.start, "");
          return false;
        }
        return true;
      default:
        finish(w, TaskStatus::kInternal, 0, 0, p.start, "not a storage task");
        return false;
    }
  }

  // ---- Phase 2, on a worker, by priority: move the objects. No cross-rank wait here, so the
  // priority order (which may differ between ranks) can never deadlock the agreement. ----

  // STORAGE_READ and PREFETCH: loads the agreed prefix chunk by chunk through `slice`.
  void run_load(const Prepared& p, std::byte* slice) {
    const auto& w = p.work;
    const auto start = p.start;
    const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
    const std::size_t n = p.agreed;
    const auto& tensors = host ? t.host_tensors : t.device_tensors;
    std::size_t loaded = 0;
    std::vector<std::byte*> dst(chunk_objects);
    const std::size_t step = cancel_step();
    while (loaded < n) {
      if (past_deadline(w, start, loaded, n)) return;
      const std::size_t c = std::min(step, n - loaded);
      if (!may_continue(w.header.task_id, loaded + c == n)) {
        finish(w, TaskStatus::kCancelled, loaded, 0, start, "cancelled after " + std::to_string(loaded) + " of " +
                                                                std::to_string(n) + " blocks");
        return;
      }
      for (std::size_t i = 0; i < c; ++i) dst[i] = slice + i * t.object_bytes;
      const auto ids = std::span(p.ids).subspan(loaded, c);
      if (revoked(w)) return;  // checked right before writing engine memory
      if (host && pool != nullptr) pool->mark_invalid(ids);
      // Each verified object is scattered into its block on the store's I/O thread that read it,
      // while later objects are still being read. An object after a miss on this rank may land
      // in its (reserved) block too; only the leading blocks_done are reported loaded. The file
      // store lends each verified payload from its own cache-warm buffer; other stores verify
      // into this worker's staging.
      Mutex err_mu;
      std::string scatter_error;
      auto scatter = [&](std::size_t i, const std::byte* payload) {
        const auto one = ids.subspan(i, 1);
        if (host) {
          kernels::scatter_from_staging_host(tensors, one, payload);
        } else if (auto s2 = backend.scatter_from_staging(tensors, one, payload); !s2.ok()) {
          MutexLock g(err_mu);
          scatter_error = s2.error().message;
        }
      };
      const auto chunk_keys = std::span(p.stored).subspan(loaded, c);
      // Lent payloads are pageable memory: only where the CPU does the scatter (host blocks, or
      // a backend whose tensors it can write); a DMA to the device wants pinned staging.
      auto got = t.store->lends_payloads() && (host || backend.tensors_host_accessible())
                     ? t.store->get_lent(chunk_keys, [&](std::size_t i, std::span<const std::byte> payload) {
                         scatter(i, payload.data());
                       })
                     : t.store->get_each(chunk_keys, std::span(dst).first(c), [&](std::size_t i) { scatter(i, dst[i]); });
      if (!got.ok()) {
        const auto code = got.error().code;
        finish(w, code == storage::StorageErrc::kUnavailable ? TaskStatus::kStorageUnavailable : TaskStatus::kStorageError,
               0, 0, start, unavailable(got.error().message));
        return;
      }
      if (!scatter_error.empty()) {
        finish(w, TaskStatus::kDeviceError, 0, 0, start, scatter_error);
        return;
      }
      std::size_t ok = 0;
      while (ok < c && (*got)[ok] == storage::ObjectResult::kOk) ++ok;
      if (host && pool != nullptr) pool->mark_valid(ids.first(ok));
      loaded += ok;
      if (ok < c && (*got)[ok] == storage::ObjectResult::kFailed) {
        // The store failed (a server that died, an I/O error), which is not a miss: the engine
        // must be able to tell "not stored" from "store down". The blocks before it are loaded.
        {
          MutexLock g(stats_mu);
          st.objects_read += ok;
          st.bytes_read += ok * t.object_bytes;
        }
        finish(w, TaskStatus::kStorageUnavailable, loaded, 0, start,
               unavailable("the store failed reading key " + w.section.keys[loaded] + " after " +
                           std::to_string(loaded) + " of " + std::to_string(n) + " blocks: " + t.store->last_error()));
        return;
      }
      {
        MutexLock g(stats_mu);
        st.objects_read += ok;
        st.bytes_read += ok * t.object_bytes;
      }
      if (ok < c) {
        KVTD_INFO("task {}: {} of key {} on this rank; loaded {} of {} agreed blocks", w.header.task_id,
                  storage::object_result_name((*got)[ok]), w.section.keys[loaded], loaded, n);
        break;
      }
    }
    finish(w, TaskStatus::kOk, loaded, 0, start, "");
  }

  void run_write(const Prepared& p, std::byte* slice) {
    const auto& w = p.work;
    const auto start = p.start;
    const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
    const auto& stored = p.stored;
    const auto& ids = p.ids;
    const std::size_t skip = p.agreed;
    const std::uint64_t skipped = (w.section.keys.size() - p.which.size()) + skip;
    if (host && pool != nullptr) {
      if (auto bad = pool->first_invalid(std::span(ids).subspan(skip))) {
        finish(w, TaskStatus::kHostTierLost, 0, 0, start,
               "host block " + std::to_string(*bad) + " holds no data written in this session; nothing stored");
        return;
      }
    }
    // MLA: the cache is replicated, one copy serves every rank; rank 0 writes it.
    const bool writer = !t.replicated || ep.rank() == 0;
    const bool in_place = t.store->writes_parts() && (host || backend.tensors_host_accessible());
    const auto& tensors = host ? t.host_tensors : t.device_tensors;
    std::size_t written = skip;
    std::vector<const std::byte*> src(chunk_objects);
    const std::size_t step = cancel_step();
    while (written < stored.size()) {
      if (revoked(w)) return;
      if (past_deadline(w, start, written - skip, stored.size() - skip)) return;
      const std::size_t c = std::min(step, stored.size() - written);
      if (!may_continue(w.header.task_id, written + c == stored.size())) {
        finish(w, TaskStatus::kCancelled, written - skip, skipped, start,
               "cancelled after writing " + std::to_string(written - skip) + " of " + std::to_string(stored.size() - skip) +
                   " blocks");
        return;
      }
      if (writer && in_place) {
        // The blocks are readable where they are (host pool; host-backend tensors): each object
        // is written straight from its pieces, no staging copy. Adjacent pieces merge, so a
        // page-first host block is one piece: the object exactly as it lies in the pool.
        const auto chunk_ids = std::span(ids).subspan(written, c);
        std::vector<storage::ObjectStore::Parts> objects(c);
        for (std::size_t i = 0; i < c; ++i) {
          objects[i].reserve(tensors.size());
          for (const auto& tensor : tensors) {
            const std::byte* at = tensor.base + static_cast<std::uint64_t>(chunk_ids[i]) * tensor.stride;
            auto& parts = objects[i];
            if (!parts.empty() && parts.back().data() + parts.back().size() == at)
              parts.back() = {parts.back().data(), parts.back().size() + tensor.block_bytes};
            else
              parts.emplace_back(at, tensor.block_bytes);
          }
        }
        auto put = t.store->put_parts(std::span(stored).subspan(written, c), objects);
        if (!check_put(w, put, c, start)) return;
      } else if (writer) {
        const auto chunk_ids = std::span(ids).subspan(written, c);
        for (std::size_t i = 0; i < c; ++i) src[i] = slice + i * t.object_bytes;
        // Each object is gathered into staging on the I/O thread that writes it next.
        Mutex err_mu;
        std::string gather_error;
        auto put = t.store->put_each(std::span(stored).subspan(written, c), std::span(src).first(c), [&](std::size_t i) {
          const auto one = chunk_ids.subspan(i, 1);
          auto* to = const_cast<std::byte*>(src[i]);
          if (host) {
            kernels::gather_to_staging_host(tensors, one, to);
            return true;
          }
          auto s2 = backend.gather_to_staging(tensors, one, to);
          if (s2.ok()) return true;
          MutexLock g(err_mu);
          gather_error = s2.error().message;
          return false;  // never store what a failed gather left in staging
        });
        if (!gather_error.empty()) {
          finish(w, TaskStatus::kDeviceError, 0, 0, start, gather_error);
          return;
        }
        if (!check_put(w, put, c, start)) return;
      }
      written += c;
    }
    finish(w, TaskStatus::kOk, written - skip, skipped, start, "");
  }

  // The task's deadline, checked between chunks: past it, the task fails saying how far it got.
  bool past_deadline(const StorageWork& w, std::int64_t start, std::size_t done, std::size_t of) {
    if (w.header.deadline_ns == 0) return false;
    const std::int64_t now = ipc::monotonic_now_ns();
    if (now <= w.header.deadline_ns) return false;
    finish(w, TaskStatus::kDeadlineExceeded, 0, 0, start,
           "deadline passed after " + std::to_string(done) + " of " + std::to_string(of) + " blocks");
    return true;
  }

  // The outcome of one chunk's put: false (the task completed as failed) unless every object
  // was written.
  bool check_put(const StorageWork& w, const Result<std::vector<storage::ObjectResult>, storage::StorageErrc>& put,
                 std::size_t c, std::int64_t start) {
    if (!put.ok()) {
      const auto code = put.error().code;
      finish(w, code == storage::StorageErrc::kUnavailable ? TaskStatus::kStorageUnavailable : TaskStatus::kStorageError, 0,
             0, start, unavailable(put.error().message));
      return false;
    }
    std::size_t failed = 0;
    for (std::size_t i = 0; i < c; ++i) failed += (*put)[i] != storage::ObjectResult::kOk;
    if (failed != 0) {
      // Each object is whole or absent (the stores write then rename); the others stand.
      finish(w, TaskStatus::kStorageError, 0, 0, start,
             unavailable(std::to_string(failed) + " of " + std::to_string(c) +
                         " objects not written: " + cause_of(t.store->last_error())));
      return false;
    }
    MutexLock g(stats_mu);
    st.objects_written += c;
    st.bytes_written += c * t.object_bytes;
    return true;
  }

  void forget(const StorageWork& w) {
    {
      MutexLock g(mu);
      live.erase(w.header.task_id);
      cancelled.erase(w.header.task_id);
      committed.erase(w.header.task_id);
    }
    release(w);
  }

  // Waits on `wake` until take() (called under mu) hands something over or says to stop.
  template <typename Take>
  bool wait_for(Wake& wake, Take&& take) {
    for (;;) {
      const std::uint32_t seen = wake.word.load(std::memory_order_acquire);
      {
        MutexLock g(mu);
        if (auto r = take(); r.has_value()) return *r;
      }
      (void)ipc::wait_on_word(wake.word, seen, ipc::monotonic_now_ns() + 50'000'000, &wake.waiters, 50'000);
    }
  }

  void agreement_loop() {
    for (;;) {
      Prepared p;
      const bool got = wait_for(agree_wake, [&]() REQUIRES(mu) -> std::optional<bool> {
        if (!agreeing.empty()) {
          p.work = std::move(agreeing.front());
          agreeing.pop_front();
          return true;
        }
        if (closing) return false;
        return std::nullopt;
      });
      if (!got) break;
      if (!agree_phase(p)) {
        forget(p.work);
        continue;
      }
      const bool write = static_cast<TaskKind>(p.work.header.kind) == TaskKind::kStorageWrite;
      {
        MutexLock g(mu);
        (write ? low : high).push_back(std::move(p));
      }
      work_wake.bump();
    }
    {
      MutexLock g(mu);
      agree_done = true;
    }
    work_wake.bump();
  }

  void worker_loop(std::size_t index) {
    start_copy_thread(("kvtd-io" + std::to_string(index)).c_str(), t.numa_node);
    std::byte* slice = staging[index];
    for (;;) {
      Prepared p;
      const bool got = wait_for(work_wake, [&]() REQUIRES(mu) -> std::optional<bool> {
        auto& q = !high.empty() ? high : low;
        if (!q.empty()) {
          p = std::move(q.front());
          q.pop_front();
          return true;
        }
        if (agree_done) return false;  // closing, and nothing more can be handed over
        return std::nullopt;
      });
      if (!got) return;
      if (!revoked(p.work)) {
        if (static_cast<TaskKind>(p.work.header.kind) == TaskKind::kStorageWrite) run_write(p, slice);
        else run_load(p, slice);
      }
      forget(p.work);
    }
  }
};

Result<std::unique_ptr<StorageExecutor>, DeviceErrc> StorageExecutor::create(endpoint::RankEndpoint& ep, DeviceBackend& backend,
                                                                              HostPool* pool, StorageTargets targets,
                                                                              Complete complete, Release release) {
  auto impl = std::make_unique<Impl>(ep, backend, pool, std::move(targets), std::move(complete), std::move(release));
  auto& t = impl->t;
  const std::uint64_t threads = t.config.io_threads;
  const std::uint64_t staging_bytes = t.config.staging_mib << 20;
  const std::uint64_t per_worker = staging_bytes / threads;
  if (t.store != nullptr) {
    if (auto why = staging_problem(t.config, t.object_bytes); !why.empty()) return make_error(DeviceErrc::kAllocFailed, why);
  }
  impl->chunk_objects = t.object_bytes == 0 ? 0 : static_cast<std::size_t>(per_worker / t.object_bytes);
  // Staging exists only when there is a store to move objects through.
  const std::size_t slice_bytes = t.store ? impl->chunk_objects * t.object_bytes : 0;
  for (std::uint64_t i = 0; i < threads; ++i) {
    std::byte* p = nullptr;
    if (slice_bytes != 0) {
      auto a = HostBuffer::allocate(backend, slice_bytes);
      if (!a.ok()) return std::move(a).error();
      p = a->data();
      impl->staging_memory.push_back(std::move(a).value());  // returned when the executor ends
    }
    impl->staging.push_back(p);
  }
  auto* raw = impl.get();
  raw->agreement = std::thread([raw] { raw->agreement_loop(); });
  for (std::uint64_t i = 0; i < threads; ++i) raw->workers.emplace_back([raw, i] { raw->worker_loop(i); });
  return std::unique_ptr<StorageExecutor>(new StorageExecutor(std::move(impl)));
}

StorageExecutor::StorageExecutor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StorageExecutor::~StorageExecutor() { close(); }

void StorageExecutor::close() {
  {
    MutexLock g(impl_->mu);
    impl_->closing = true;
  }
  impl_->agree_wake.bump();
  if (impl_->agreement.joinable()) impl_->agreement.join();
  impl_->work_wake.bump();  // idle workers see `closing` now, not at the end of their wait slice
  for (auto& th : impl_->workers)
    if (th.joinable()) th.join();
}

void StorageExecutor::submit(StorageWork&& w) {
  {
    MutexLock g(impl_->mu);
    impl_->live.insert(w.header.task_id);
    impl_->agreeing.push_back(std::move(w));
  }
  impl_->agree_wake.bump();
}

bool StorageExecutor::cancel(std::uint64_t task_id) {
  MutexLock g(impl_->mu);
  // Past its last check the task will complete as it is: saying it stops would be a lie.
  if (!impl_->live.count(task_id) || impl_->committed.count(task_id)) return false;
  impl_->cancelled.insert(task_id);
  return true;
}

std::size_t StorageExecutor::drop_queued() {
  std::deque<StorageWork> dropped;
  {
    MutexLock g(impl_->mu);
    auto take = [&](StorageWork&& w) REQUIRES(impl_->mu) {
      impl_->live.erase(w.header.task_id);
      impl_->cancelled.erase(w.header.task_id);
      impl_->committed.erase(w.header.task_id);
      dropped.push_back(std::move(w));
    };
    for (auto& w : impl_->agreeing) take(std::move(w));
    impl_->agreeing.clear();
    for (auto* q : {&impl_->high, &impl_->low}) {
      for (auto& p : *q) take(std::move(p.work));
      q->clear();
    }
  }
  for (auto& w : dropped) impl_->release(w);
  return dropped.size();
}

StorageStats StorageExecutor::stats() const {
  MutexLock g(impl_->stats_mu);
  return impl_->st;
}

}  // namespace kvtd::daemon
