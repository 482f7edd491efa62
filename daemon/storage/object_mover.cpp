// Phase 2 of a storage task, on an I/O worker: objects between the blocks and the store through the
// worker's staging slice, with the cancel, revocation and deadline checks between steps.
#include "object_mover.h"

#include <algorithm>
#include <fmt/format.h>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/status_of.h"
#include "kvtd/events/kv_events.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/kernels/host_copy.h"

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

std::vector<std::vector<kernels::LayerTensor>> part_views(std::span<const kernels::LayerTensor> tensors,
                                                          std::uint32_t parts) {
  // Heads are the outermost dimension of every tensor's block: part p is the p-th equal share of
  // each block, at the same stride.
  std::vector<std::vector<kernels::LayerTensor>> out(parts);
  for (std::uint32_t p = 0; p < parts; ++p)
    for (const auto& t : tensors) {
      const std::uint64_t share = t.block_bytes / parts;
      out[p].push_back(kernels::LayerTensor{t.base + p * share, share, t.stride});
    }
  return out;
}

namespace {

// "write /long/path/x.kvo: No space left on device" -> "No space left on device (write /long/...)".
std::string cause_of(const std::string& error) {
  const auto at = error.rfind(": ");
  if (at == std::string::npos) return error;
  return error.substr(at + 2) + " (" + error.substr(0, at) + ")";
}

}  // namespace

using proto::Outcome;
using proto::TaskStatus;

ObjectMover::Moved ObjectMover::stats() const {
  MutexLock g(mu_);
  return moved_;
}

std::size_t ObjectMover::cancel_step() const {
  constexpr std::uint64_t kStepBytes = 4ull << 20;
  const std::uint64_t key_bytes = t_.key_bytes();
  const std::uint64_t by_bytes = key_bytes == 0 ? 1 : std::max<std::uint64_t>(1, kStepBytes / key_bytes);
  const std::uint64_t step = std::max<std::uint64_t>(by_bytes, t_.config.io_threads);
  const std::uint64_t fits = chunk_objects_ / t_.slicing.parts;  // every part of a key in the slice
  return static_cast<std::size_t>(std::max<std::uint64_t>(1, std::min<std::uint64_t>(step, fits)));
}

std::optional<Outcome> ObjectMover::check_put(const storage::BatchResult& put, std::size_t c,
                                              std::uint64_t object_bytes) {
  if (!put.ok())
    return Outcome::failed(status_of(put.error().code, StoreCall::kWrite), unavailable(put.error().message));
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
  if (failed != 0)  // each object is whole or absent (the stores write then rename); the others stand
    return Outcome::failed(status, unavailable(fmt::format("{} of {} objects not written: {}", failed, c, cause)));
  MutexLock g(mu_);
  moved_.objects_written += c;
  moved_.bytes_written += c * object_bytes;
  return std::nullopt;
}

ObjectMover::Step ObjectMover::load_chunk(const ObjectTarget& target, bool host, std::span<const std::int32_t> ids,
                                          std::span<const std::string> objects, std::byte* slice) {
  const auto& parts = *target.views;
  const std::size_t n = parts.size();  // object i is view i % n of block ids[i / n]
  const std::uint64_t object_bytes = target.object_bytes;
  DeviceError scatter_error;  // set by the store's I/O threads
  storage::ReadInto into;
  // A block's bytes may land before they are verified: a block whose object fails verification
  // never counts as loaded (a host block stays invalid: marked before the load, valid only for
  // the loaded prefix; a device block lies past blocks_done, like a block after a miss).
  into.unverified_bytes_ok = true;
  // Object i's slot of this worker's staging. Declared here, not in the branch that uses it: the
  // store calls the lambdas below after the branch has ended (a slot lambda local to the branch
  // was read after its scope ended: the stand-in's CUDA daemon died of it in CI).
  const auto slot = [slice, object_bytes](std::size_t i) { return slice + i * object_bytes; };
  if (host) {
    // The daemon's own host-pool blocks: each object goes straight into its block's pieces. A
    // store that reads in place reads and verifies it there (one copy, from the kernel into
    // place; on 2 cores the scratch copy this saves was a quarter of a warm read's CPU time,
    // STORAGE_READ 6.4 -> 7.4 GB/s, scripts/bench.sh); others copy each verified payload in.
    // Never the engine's memory (stores_in_place).
    into.pieces = [&](std::size_t i) { return block_pieces(parts[i % n], ids[i / n]); };
  } else {
    // The engine's memory (CUDA; host-backend tensors, through the backend's guarded copy): each
    // object is read into its slot of this worker's pinned staging and verified there, then its
    // DMA (copy) goes from the slot on the store's I/O thread that read it,
    // while later objects are still being read. No CPU copy between the read and the DMA, and a
    // slot whose object fails is never copied to the device. An object after a miss on this rank
    // may land in its (reserved) block too; only the leading blocks_done are reported loaded.
    into.pieces = [&](std::size_t i) { return storage::Pieces{{slot(i), object_bytes}}; };
    into.on_verified = [&](std::size_t i) {
      if (auto s2 = copies_.scatter_from_staging(parts[i % n], ids.subspan(i / n, 1), slot(i)); !s2.ok())
        scatter_error.set(s2.error().message);
    };
  }
  auto got = target.store->read(objects, into);
  if (!got.ok())
    return {{}, Outcome::failed(status_of(got.error().code, StoreCall::kRead), unavailable(got.error().message))};
  if (auto e = scatter_error.get(); !e.empty()) return {{}, Outcome::failed(TaskStatus::kDeviceError, e)};
  return {std::move(got).value(), std::nullopt};
}

std::optional<Outcome> ObjectMover::failed_read(const Prepared& p, const storage::KeyResult& key, std::size_t loaded,
                                                std::size_t of) const {
  const auto status = status_of(key.result, StoreCall::kRead);
  if (status == TaskStatus::kOk) return std::nullopt;  // a miss
  // The store failed (a server that died, an I/O error), which is not a miss: the engine must be
  // able to tell "not stored" from "store down". The blocks before it are loaded.
  return Outcome::stopped(status, loaded,
                          unavailable(fmt::format("the store failed reading key {} after {} of {} blocks: {}",
                                                  p.work.section.keys[p.which[loaded]], loaded, of, key.error)));
}

std::optional<Outcome> ObjectMover::load(const Prepared& p, std::byte* slice) {
  if (!t_.groups.empty()) return load_groups(p, slice);
  const auto& w = p.work;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  const std::size_t n = p.agreed;
  std::size_t loaded = 0;
  const std::size_t step = cancel_step();
  while (loaded < n) {
    if (auto late = past_deadline(w, loaded, n)) return late;
    const std::size_t c = std::min(step, n - loaded);
    if (!queues_.may_continue(w.header.task_id, loaded + c == n))
      return Outcome::stopped(TaskStatus::kCancelled, loaded,
                              fmt::format("cancelled after {} of {} blocks", loaded, n));
    const auto ids = std::span(p.ids).subspan(loaded, c);
    if (revoked(w)) return std::nullopt;  // checked right before writing engine memory
    if (host && pool_ != nullptr) pool_->mark_invalid(ids);
    auto got = load_chunk(parts_target(host), host, ids, std::span(p.stored).subspan(loaded * p.parts, c * p.parts), slice);
    if (got.ended) return got.ended;
    std::size_t ok_objects = 0;  // a key is loaded when every part of it is
    while (ok_objects < c * p.parts && got.keys[ok_objects].ok()) ++ok_objects;
    const std::size_t ok = ok_objects / p.parts;
    if (host && pool_ != nullptr) pool_->mark_valid(ids.first(ok));
    {
      MutexLock g(mu_);
      moved_.objects_read += ok * p.parts;
      moved_.bytes_read += ok * t_.key_bytes();
    }
    loaded += ok;
    if (ok == c) continue;
    const auto& first_bad = got.keys[ok_objects];
    if (auto failed = failed_read(p, first_bad, loaded, n)) return failed;
    KVTD_INFO("task {}: {} of key {} on this rank; loaded {} of {} agreed blocks", w.header.task_id,
              storage::object_result_name(first_bad.result), w.section.keys[p.which[loaded]], loaded, n);
    break;
  }
  return Outcome::ok(loaded);
}

std::optional<Outcome> ObjectMover::write(const Prepared& p, std::byte* slice) {
  if (!t_.groups.empty()) return write_groups(p, slice);
  const auto& w = p.work;
  const bool host = (w.header.flags & proto::kTaskFlagHostBlocks) != 0;
  const std::size_t keys = p.keys();
  const std::size_t skip = p.agreed;
  const std::uint64_t skipped = (w.section.keys.size() - p.which.size()) + skip;
  if (auto late = stale_backup(p)) return late;
  if (host && pool_ != nullptr)
    if (auto bad = pool_->first_invalid(std::span(p.ids).subspan(skip)))
      return Outcome::failed(TaskStatus::kHostTierLost,
                             fmt::format("host block {} holds no data written in this session; nothing stored", *bad));
  // One copy of a replicated slice is enough (MLA: rank 0; a head on several ranks: its first).
  const bool writer = t_.slicing.writer;
  const bool in_place = stores_in_place(host);
  std::size_t written = skip;
  const std::size_t step = cancel_step();
  while (written < keys) {
    if (revoked(w)) return std::nullopt;
    if (auto late = past_deadline(w, written - skip, keys - skip)) return late;
    const std::size_t c = std::min(step, keys - written);
    if (!queues_.may_continue(w.header.task_id, written + c == keys))
      return Outcome::stopped(TaskStatus::kCancelled, written - skip,
                              fmt::format("cancelled after writing {} of {} blocks", written - skip, keys - skip))
          .with_skipped(skipped);
    if (writer)
      if (auto ended = write_chunk(p, written, c, in_place, slice)) return ended;
    written += c;
  }
  if (t_.kv_events != nullptr && writer && written > skip) {
    std::vector<std::string> stored_keys;  // one event per key, whatever its parts
    stored_keys.reserve(written - skip);
    for (std::size_t i = skip; i < written; ++i) stored_keys.push_back(w.section.keys[p.which[i]]);
    t_.kv_events->stored(std::move(stored_keys));
  }
  return Outcome::written(written - skip, skipped);
}

std::optional<Outcome> ObjectMover::stale_backup(const Prepared& p) const {
  // Agreed, but then waited for a write worker past its age: the workers are held by a slow store.
  const std::int64_t waited_ms = (ipc::monotonic_now_ns() - p.queued_ns) / 1'000'000;
  if (!is_backup(p.work) || waited_ms <= static_cast<std::int64_t>(t_.config.backup_max_age_ms)) return std::nullopt;
  return Outcome::failed(TaskStatus::kBackupSkipped,
                         fmt::format("backup skipped: it waited {} ms for a write worker "
                                     "(--storage-backup-max-age-ms {})", waited_ms, t_.config.backup_max_age_ms))
      .with_skipped(p.work.section.keys.size());
}

std::optional<Outcome> ObjectMover::write_chunk(const Prepared& p, std::size_t from, std::size_t c, bool in_place,
                                                std::byte* slice) {
  const bool host = (p.work.header.flags & proto::kTaskFlagHostBlocks) != 0;
  return write_objects(parts_target(host), host, std::span(p.ids).subspan(from, c),
                       std::span(p.stored).subspan(from * p.parts, c * p.parts), in_place, slice);
}

std::optional<Outcome> ObjectMover::write_objects(const ObjectTarget& target, bool host,
                                                  std::span<const std::int32_t> chunk_ids,
                                                  std::span<const std::string> names, bool in_place, std::byte* slice) {
  const auto& parts = *target.views;
  const std::size_t n = parts.size();  // object i is view i % n of block chunk_ids[i / n]
  const std::uint64_t object_bytes = target.object_bytes;
  storage::WriteFrom source;
  if (in_place) {
    // The blocks are the daemon's host pool, readable where they are: each object is written
    // straight from its pieces, no staging copy. Adjacent pieces merge, so a page-first
    // host block is one piece: the object exactly as it lies in the pool.
    source.pieces = [&](std::size_t i) -> std::optional<storage::ConstPieces> {
      const auto pieces = block_pieces(parts[i % n], chunk_ids[i / n]);
      return storage::ConstPieces(pieces.begin(), pieces.end());
    };
    return check_put(target.store->write(names, source), names.size(), object_bytes);
  }
  // Each object is gathered into its slot of staging on the I/O thread that writes it next.
  DeviceError gather_error;  // set by the store's I/O threads
  source.pieces = [&](std::size_t i) -> std::optional<storage::ConstPieces> {
    const auto one = chunk_ids.subspan(i / n, 1);
    std::byte* to = slice + i * object_bytes;
    if (host) {
      kernels::gather_to_staging_host(parts[i % n], one, to);
    } else if (auto gathered = copies_.gather_to_staging(parts[i % n], one, to); !gathered.ok()) {
      gather_error.set(gathered.error().message);
      return std::nullopt;  // never store what a failed gather left in staging
    }
    return storage::ConstPieces{{to, object_bytes}};
  };
  auto put = target.store->write(names, source);
  if (auto e = gather_error.get(); !e.empty()) return Outcome::failed(TaskStatus::kDeviceError, e);
  return check_put(put, names.size(), object_bytes);
}

bool ObjectMover::stores_in_place(bool host) const { return host && t_.store->capabilities().writes_pieces; }

std::optional<Outcome> ObjectMover::past_deadline(const StorageWork& w, std::size_t done, std::size_t of) const {
  if (w.header.deadline_ns == 0 || ipc::monotonic_now_ns() <= w.header.deadline_ns) return std::nullopt;
  return Outcome::failed(TaskStatus::kDeadlineExceeded,
                         fmt::format("deadline passed after {} of {} blocks", done, of));
}

}  // namespace kvtd::daemon
