// Phase 2 of a storage task, on an I/O worker: objects between the blocks and the store through the
// worker's staging slice, with the cancel and deadline checks between steps.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/ipc/wait.h"
#include "kvtd/storage/object_format.h"
#include "kvtd/events/kv_events.h"
#include "kvtd/storage/object_store.h"
#include "executor_impl.h"
#include "kvtd/daemon/status_of.h"

namespace kvtd::daemon {

namespace {

// A device error met by one of several I/O threads of one chunk (the last one is kept).
class DeviceError {
 public:
  void set(std::string message) {
    MutexLock g(mu_);
    text_ = std::move(message);
  }
  std::string get() const {
    MutexLock g(mu_);
    return text_;
  }

 private:
  mutable Mutex mu_;
  std::string text_ GUARDED_BY(mu_);
};

// The pieces of block `id` in `tensors`, in the stored object's order (every tensor's block, layer
// by layer); adjacent pieces are merged (a page-first host pool gives one).
std::vector<std::span<std::byte>> block_pieces(std::span<const kernels::LayerTensor> tensors, std::int32_t id) {
  std::vector<std::span<std::byte>> pieces;
  pieces.reserve(tensors.size());
  for (const auto& t : tensors) {
    std::byte* at = t.base + static_cast<std::uint64_t>(id) * t.stride;
    if (!pieces.empty() && pieces.back().data() + pieces.back().size() == at)
      pieces.back() = std::span<std::byte>(pieces.back().data(), pieces.back().size() + t.block_bytes);
    else
      pieces.emplace_back(at, t.block_bytes);
  }
  return pieces;
}

}  // namespace

namespace {

// "write /long/path/x.kvo: No space left on device" -> "No space left on device (write /long/...)".
std::string cause_of(const std::string& error) {
  const auto at = error.rfind(": ");
  if (at == std::string::npos) return error;
  return error.substr(at + 2) + " (" + error.substr(0, at) + ")";
}

}  // namespace

bool StorageExecutor::Impl::check_put(const StorageWork& w, const storage::BatchResult& put, std::size_t c,
                                      std::int64_t start) {
  if (!put.ok()) {
    finish(w, proto::Outcome::failed(status_of(put.error().code, StoreCall::kWrite), unavailable(put.error().message)),
           start);
    return false;
  }
  std::size_t failed = 0;
  auto status = TaskStatus::kOk;
  std::string cause;
  for (std::size_t i = 0; i < c; ++i) {
    const auto& key = (*put)[i];
    if (key.ok()) continue;
    ++failed;
    if (status == TaskStatus::kOk) {  // the first failed object's status and its own cause
      status = status_of(key.result, StoreCall::kWrite);
      cause = cause_of(key.error);
    }
  }
  if (failed != 0) {
    // Each object is whole or absent (the stores write then rename); the others stand.
    finish(w,
           proto::Outcome::failed(status, unavailable(std::to_string(failed) + " of " + std::to_string(c) +
                                                      " objects not written: " + cause)),
           start);
    return false;
  }
  MutexLock g(stats_mu);
  st.objects_written += c;
  st.bytes_written += c * t.object_bytes;
  return true;
}

bool StorageExecutor::Impl::is_cancelled(std::uint64_t id) {
  MutexLock g(mu);
  return cancelled.count(id) != 0;
}

std::size_t StorageExecutor::Impl::cancel_step() const {
  constexpr std::uint64_t kStepBytes = 4ull << 20;
  const std::uint64_t by_bytes = t.object_bytes == 0 ? 1 : std::max<std::uint64_t>(1, kStepBytes / t.object_bytes);
  const std::uint64_t step = std::max<std::uint64_t>(by_bytes, t.config.io_threads);
  return static_cast<std::size_t>(std::max<std::uint64_t>(1, std::min<std::uint64_t>(step, chunk_objects)));
}

bool StorageExecutor::Impl::may_continue(std::uint64_t id, bool last_step) {
  MutexLock g(mu);
  if (cancelled.count(id) != 0) return false;
  if (last_step) committed.insert(id);
  return true;
}

std::optional<std::vector<storage::KeyResult>> StorageExecutor::Impl::load_chunk(
    const Prepared& p, std::span<const std::int32_t> ids, std::span<const std::string> keys, std::byte* slice) {
  const auto& w = p.work;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  const auto& tensors = host ? t.host_tensors : t.device_tensors;
  DeviceError scatter_error;  // set by the store's I/O threads
  storage::ReadInto into;
  // A block's bytes may land before they are verified: a block whose object fails verification
  // never counts as loaded (a host block stays invalid: marked before the load, valid only for
  // the loaded prefix; a device block lies past blocks_done, like a block after a miss).
  into.unverified_bytes_ok = true;
  if (host || backend.tensors_host_accessible()) {
    // Blocks the CPU can write (host-pool blocks; device blocks of a backend whose tensors are
    // host memory): each object goes straight into its block's pieces. A store that reads in
    // place reads and verifies it there (one copy, from the kernel into place; on 2 cores the
    // scratch copy this saves was a quarter of a warm read's CPU time, STORAGE_READ 6.4 -> 7.4
    // GB/s, scripts/bench.sh); others copy each verified payload in.
    into.pieces = [&](std::size_t i) { return block_pieces(tensors, ids[i]); };
  } else {
    // Device memory (CUDA): each object is read into its slot of this worker's pinned staging and
    // verified there, then its DMA goes from the slot on the store's I/O thread that read it,
    // while later objects are still being read. No CPU copy between the read and the DMA, and a
    // slot whose object fails is never copied to the device. An object after a miss on this rank
    // may land in its (reserved) block too; only the leading blocks_done are reported loaded.
    auto slot = [&](std::size_t i) { return slice + i * t.object_bytes; };
    into.pieces = [&](std::size_t i) { return storage::Pieces{{slot(i), t.object_bytes}}; };
    into.on_verified = [&](std::size_t i) {
      if (auto s2 = backend.scatter_from_staging(tensors, ids.subspan(i, 1), slot(i)); !s2.ok())
        scatter_error.set(s2.error().message);
    };
  }
  auto got = t.store->read(keys, into);
  if (!got.ok()) {
    finish(w, proto::Outcome::failed(status_of(got.error().code, StoreCall::kRead), unavailable(got.error().message)),
           p.start);
    return std::nullopt;
  }
  if (auto e = scatter_error.get(); !e.empty()) {
    finish(w, proto::Outcome::failed(TaskStatus::kDeviceError, e), p.start);
    return std::nullopt;
  }
  return std::move(got).value();
}

void StorageExecutor::Impl::run_load(const Prepared& p, std::byte* slice) {
  const auto& w = p.work;
  const auto start = p.start;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  const std::size_t n = p.agreed;
  std::size_t loaded = 0;
  const std::size_t step = cancel_step();
  while (loaded < n) {
    if (past_deadline(w, start, loaded, n)) return;
    const std::size_t c = std::min(step, n - loaded);
    if (!may_continue(w.header.task_id, loaded + c == n)) {
      finish(w,
             proto::Outcome::stopped(TaskStatus::kCancelled, loaded,
                                     "cancelled after " + std::to_string(loaded) + " of " + std::to_string(n) + " blocks"),
             start);
      return;
    }
    const auto ids = std::span(p.ids).subspan(loaded, c);
    if (revoked(w)) return;  // checked right before writing engine memory
    if (host && pool != nullptr) pool->mark_invalid(ids);
    auto got = load_chunk(p, ids, std::span(p.stored).subspan(loaded, c), slice);
    if (!got) return;  // finished as failed
    std::size_t ok = 0;
    while (ok < c && (*got)[ok].ok()) ++ok;
    if (host && pool != nullptr) pool->mark_valid(ids.first(ok));
    loaded += ok;
    if (ok < c && status_of((*got)[ok].result, StoreCall::kRead) != TaskStatus::kOk) {
      // The store failed (a server that died, an I/O error), which is not a miss: the engine
      // must be able to tell "not stored" from "store down". The blocks before it are loaded.
      {
        MutexLock g(stats_mu);
        st.objects_read += ok;
        st.bytes_read += ok * t.object_bytes;
      }
      finish(w,
             proto::Outcome::stopped(status_of((*got)[ok].result, StoreCall::kRead), loaded,
                                     unavailable("the store failed reading key " + w.section.keys[loaded] + " after " +
                                                 std::to_string(loaded) + " of " + std::to_string(n) +
                                                 " blocks: " + (*got)[ok].error)),
             start);
      return;
    }
    {
      MutexLock g(stats_mu);
      st.objects_read += ok;
      st.bytes_read += ok * t.object_bytes;
    }
    if (ok < c) {
      KVTD_INFO("task {}: {} of key {} on this rank; loaded {} of {} agreed blocks", w.header.task_id,
                storage::object_result_name((*got)[ok].result), w.section.keys[loaded], loaded, n);
      break;
    }
  }
  finish(w, proto::Outcome::ok(loaded), start);
}

void StorageExecutor::Impl::run_write(const Prepared& p, std::byte* slice) {
  const auto& w = p.work;
  const auto start = p.start;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  const auto& stored = p.stored;
  const auto& ids = p.ids;
  const std::size_t skip = p.agreed;
  const std::uint64_t skipped = (w.section.keys.size() - p.which.size()) + skip;
  // Agreed, but then waited for a write worker past its age: the workers are held by a slow store.
  const std::int64_t waited_ms = (ipc::monotonic_now_ns() - p.queued_ns) / 1'000'000;
  if (is_backup(w) && waited_ms > static_cast<std::int64_t>(t.config.backup_max_age_ms)) {
    answer_skipped(w, start,
                   "backup skipped: it waited " + std::to_string(waited_ms) +
                       " ms for a write worker (--storage-backup-max-age-ms " +
                       std::to_string(t.config.backup_max_age_ms) + ")",
                   /*new_task=*/false);
    return;
  }
  if (host && pool != nullptr) {
    if (auto bad = pool->first_invalid(std::span(ids).subspan(skip))) {
      finish(w,
             proto::Outcome::failed(TaskStatus::kHostTierLost, "host block " + std::to_string(*bad) +
                                                                   " holds no data written in this session; nothing stored"),
             start);
      return;
    }
  }
  // MLA: the cache is replicated, one copy serves every rank; rank 0 writes it.
  const bool writer = !t.replicated || ep.rank() == 0;
  const bool in_place = t.store->capabilities().writes_pieces && (host || backend.tensors_host_accessible());
  std::size_t written = skip;
  const std::size_t step = cancel_step();
  while (written < stored.size()) {
    if (revoked(w)) return;
    if (past_deadline(w, start, written - skip, stored.size() - skip)) return;
    const std::size_t c = std::min(step, stored.size() - written);
    if (!may_continue(w.header.task_id, written + c == stored.size())) {
      finish(w,
             proto::Outcome::stopped(TaskStatus::kCancelled, written - skip,
                                     "cancelled after writing " + std::to_string(written - skip) + " of " +
                                         std::to_string(stored.size() - skip) + " blocks")
                 .with_skipped(skipped),
             start);
      return;
    }
    if (writer && !write_chunk(p, written, c, in_place, slice)) return;
    written += c;
  }
  if (t.kv_events != nullptr && writer && written > skip) {
    std::vector<std::string> keys;
    keys.reserve(written - skip);
    for (std::size_t i = skip; i < written; ++i) keys.push_back(w.section.keys[p.which[i]]);
    t.kv_events->stored(std::move(keys));
  }
  finish(w, proto::Outcome::written(written - skip, skipped), start);
}

bool StorageExecutor::Impl::write_chunk(const Prepared& p, std::size_t from, std::size_t c, bool in_place,
                                        std::byte* slice) {
  const auto& w = p.work;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  const auto& tensors = host ? t.host_tensors : t.device_tensors;
  const auto chunk_ids = std::span(p.ids).subspan(from, c);
  const auto names = std::span(p.stored).subspan(from, c);
  storage::WriteFrom source;
  if (in_place) {
    // The blocks are readable where they are (host pool; host-backend tensors): each object is
    // written straight from its pieces, no staging copy. Adjacent pieces merge, so a page-first
    // host block is one piece: the object exactly as it lies in the pool.
    source.pieces = [&](std::size_t i) -> std::optional<storage::ConstPieces> {
      const auto pieces = block_pieces(tensors, chunk_ids[i]);
      return storage::ConstPieces(pieces.begin(), pieces.end());
    };
    return check_put(w, t.store->write(names, source), c, p.start);
  }
  // Each object is gathered into its slot of staging on the I/O thread that writes it next.
  DeviceError gather_error;  // set by the store's I/O threads
  source.pieces = [&](std::size_t i) -> std::optional<storage::ConstPieces> {
    const auto one = chunk_ids.subspan(i, 1);
    std::byte* to = slice + i * t.object_bytes;
    if (host) {
      kernels::gather_to_staging_host(tensors, one, to);
    } else if (auto gathered = backend.gather_to_staging(tensors, one, to); !gathered.ok()) {
      gather_error.set(gathered.error().message);
      return std::nullopt;  // never store what a failed gather left in staging
    }
    return storage::ConstPieces{{to, t.object_bytes}};
  };
  auto put = t.store->write(names, source);
  if (auto e = gather_error.get(); !e.empty()) {
    finish(w, proto::Outcome::failed(TaskStatus::kDeviceError, e), p.start);
    return false;
  }
  return check_put(w, put, c, p.start);
}

bool StorageExecutor::Impl::past_deadline(const StorageWork& w, std::int64_t start, std::size_t done, std::size_t of) {
  if (w.header.deadline_ns == 0) return false;
  const std::int64_t now = ipc::monotonic_now_ns();
  if (now <= w.header.deadline_ns) return false;
  finish(w,
         proto::Outcome::failed(TaskStatus::kDeadlineExceeded,
                                "deadline passed after " + std::to_string(done) + " of " + std::to_string(of) + " blocks"),
         start);
  return true;
}

}  // namespace kvtd::daemon
