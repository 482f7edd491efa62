#include "kvtd/base/mutex.h"
#include "kvtd/storage/file_store.h"

#include <unistd.h>
#include <filesystem>
#include <cerrno>
#include <ctime>
#include <sys/stat.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "direct_reads.h"
#include "file_store_support.h"
#include "io_pool.h"
#include "store_common.h"
#include "kvtd/proto/names.h"
#include "kvtd/storage/object_format.h"
#include "kvtd/storage/object_name.h"

namespace kvtd::storage {
namespace {

constexpr const char* kSuffix = ".kvo";
constexpr const char* kTmpPrefix = ".tmp-";

class FileStore final : public ObjectStore {
 public:
  FileStore(const FileStoreOptions& o, std::unique_ptr<FileSystem> owned)
      : opts_(o), owned_fs_(std::move(owned)), fs_(o.fs ? o.fs : owned_fs_.get()) {
    dir_ = o.root + "/" + o.store.model_id + "/" + fingerprint_hex(o.store.layout_fingerprint);
    if (o.direct_reads) direct_ = std::make_unique<detail::DirectObjectReader>(*fs_, o.store);
  }

  // --storage-io direct: whether this store's directory takes O_DIRECT reads.
  // The fan-out directories, and whether they take O_DIRECT reads (--storage-io direct).
  Status<StorageErrc> prepare_dirs() {
    KVTD_TRY(detail::make_fanout(*fs_, dir_));
    return direct_ ? direct_->check_directory(dir_ + "/00", opts_.root) : Status<StorageErrc>{};
  }

  Status<StorageErrc> load_index() EXCLUDES(mu_) {
    std::vector<FileEntry> files;
    if (int e = fs_->list_files(dir_, &files); e != 0)
      return make_error(StorageErrc::kIo, "cannot list " + dir_ + ": " + std::strerror(e));
    std::sort(files.begin(), files.end(), [](const FileEntry& a, const FileEntry& b) { return a.mtime_ns < b.mtime_ns; });
    for (const auto& f : files) {
      const auto slash = f.path.rfind('/');
      const std::string base = f.path.substr(slash + 1);
      if (base.rfind(kTmpPrefix, 0) == 0) {
        // Several daemons share a store: only a temporary whose writer is gone is garbage (a live
        // writer's rename would fail). Gone: its pid (in the name) no longer runs here, or the
        // file is older than any write takes (another pid namespace, a reused pid).
        if (detail::abandoned_temporary(base, f.mtime_ns)) fs_->remove(f.path);
        continue;
      }
      if (base.size() < 4 || base.compare(base.size() - 4, 4, kSuffix) != 0) continue;
      MutexLock g(mu_);
      touch_locked(f.path, f.bytes);
    }
    MutexLock g(mu_);
    evict_locked(lru_.empty() ? std::string() : lru_.front());
    return {};
  }

  Result<std::size_t, StorageErrc> exists(std::span<const std::string> keys) override {
    KVTD_TRY(detail::check_keys(keys));
    for (std::size_t i = 0; i < keys.size(); ++i) {
      bool present = false;
      if (int e = fs_->exists(path_of(keys[i]), &present); e != 0)
        return make_error(StorageErrc::kIo, "stat " + path_of(keys[i]) + ": " + std::strerror(e));
      if (!present) return i;
    }
    return keys.size();
  }

  StoreCapabilities capabilities() const override {
    return {.reads_in_place = direct_ == nullptr, .writes_pieces = true};
  }

  BatchResult read(std::span<const std::string> keys, const ReadInto& into) override {
    KVTD_TRY(detail::check_read(keys, into));
    auto verified = [&](std::size_t i, const KeyResult& r) {
      if (r.ok() && into.on_verified) into.on_verified(i);
      return r;
    };
    if (direct_) {  // verified in the aligned buffer, then copied into the pieces
      return read_direct(keys, [&](std::size_t i, std::span<const std::byte> payload) {
        return verified(i, detail::land(i, into.pieces(i), payload));
      });
    }
    std::vector<KeyResult> out(keys.size());
    io_pool_.run(keys.size(), opts_.io_threads, [&](std::size_t i) {
      const Pieces pieces = into.pieces(i);
      if (auto bad = detail::pieces_mismatch(i, pieces, opts_.store.object_bytes); !bad.empty()) {
        out[i] = {ObjectResult::kFailed, bad};
        return;
      }
      if (into.unverified_bytes_ok) {  // straight into the pieces, verified there
        out[i] = verified(i, read_one(keys[i], pieces));
        return;
      }
      // Read into private scratch and verify there: the caller's pieces receive the payload only
      // once it is known good, so a corrupt or foreign object never clobbers them.
      Scratch scratch(*this);
      const auto payload = scratch.span();
      out[i] = read_one(keys[i], Pieces{payload});
      if (out[i].ok()) out[i] = verified(i, detail::land(i, pieces, payload));
    });
    return out;
  }

  BatchResult write(std::span<const std::string> keys, const WriteFrom& from) override {
    KVTD_TRY(detail::check_write(keys, from));
    std::vector<KeyResult> out(keys.size());
    io_pool_.run(keys.size(), opts_.io_threads, [&](std::size_t i) {
      const auto pieces = from.pieces(i);
      if (!pieces) {
        out[i] = {ObjectResult::kFailed, "not written: " + from.refused};
      } else if (auto bad = detail::pieces_mismatch(i, *pieces, opts_.store.object_bytes); !bad.empty()) {
        out[i] = {ObjectResult::kFailed, bad};
      } else {
        out[i] = write_one(keys[i], *pieces);
        return;  // counted there
      }
      counters_.count_put(ObjectResult::kFailed);
    });
    return out;
  }

  // An object-sized scratch buffer, borrowed from a free list for one object and given back:
  // buffers outlive the per-call I/O threads, so they stay allocated and warm in cache (a
  // thread_local one was allocated and faulted in again on every call). At most one per
  // concurrent reader exists.
  class Scratch {
   public:
    explicit Scratch(const FileStore& s) : s_(s) {
      MutexLock g(s_.scratch_mu_);
      if (!s_.scratch_free_.empty()) {
        buf_ = std::move(s_.scratch_free_.back());
        s_.scratch_free_.pop_back();
      }
      if (!buf_) buf_ = std::make_unique<std::byte[]>(s_.opts_.store.object_bytes);
    }
    ~Scratch() {
      MutexLock g(s_.scratch_mu_);
      s_.scratch_free_.push_back(std::move(buf_));
    }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    std::span<std::byte> span() const { return {buf_.get(), s_.opts_.store.object_bytes}; }

   private:
    const FileStore& s_;
    std::unique_ptr<std::byte[]> buf_;
  };

  // The O_DIRECT load of a batch: its keys split over the I/O threads, each with its reads in
  // flight; on_ok(i, payload) for each object that verified.
  // on_ok's result replaces kOk (a key whose pieces do not fit fails there).
  using OnVerified = std::function<KeyResult(std::size_t index, std::span<const std::byte> payload)>;
  BatchResult read_direct(std::span<const std::string> keys, const OnVerified& on_ok) {
    std::vector<KeyResult> out(keys.size());
    const std::size_t slices = std::max<std::size_t>(1, std::min<std::size_t>(opts_.io_threads, keys.size()));
    std::atomic<int> batch_error{0};
    io_pool_.run(slices, static_cast<unsigned>(slices), [&](std::size_t s) {
      const std::size_t lo = keys.size() * s / slices, hi = keys.size() * (s + 1) / slices;
      std::vector<std::string> paths, names;
      for (std::size_t i = lo; i < hi; ++i) {
        paths.push_back(path_of(keys[i]));
        names.push_back(namespaced_key(opts_.store, keys[i]));
      }
      std::vector<ObjectResult> results;
      std::vector<int> errors;
      std::vector<KeyResult> landed(hi - lo);
      const int e = direct_->read(
          paths, names, [&](std::size_t j, std::span<const std::byte> p) { landed[j] = on_ok(lo + j, p); }, results,
          errors);
      if (e != 0) {
        batch_error.store(e);
        return;
      }
      for (std::size_t j = 0; j < results.size(); ++j) {
        out[lo + j] = results[j] == ObjectResult::kOk ? landed[j] : KeyResult{results[j], {}};
        counters_.count_get(results[j]);
        if (results[j] == ObjectResult::kFailed) out[lo + j].error = "read " + paths[j] + ": " + std::strerror(errors[j]);
        if (results[j] == ObjectResult::kOk) {
          MutexLock g(mu_);
          touch_locked(paths[j], sizeof(ObjectHeader) + opts_.store.object_bytes);
        }
      }
    });
    if (const int e = batch_error.load(); e != 0)
      return make_error(StorageErrc::kIo, std::string("direct reads under ") + opts_.root + ": " + std::strerror(e));
    return out;
  }

  // Reads one object into the consecutive `pieces` of its payload (object_bytes in all),
  // hashing each stretch as it is read (still in the cache), and verifies it. One byte past the
  // payload is asked for: an object with trailing bytes is not ours.
  KeyResult read_one(const std::string& key, const Pieces& pieces) {
    const std::string path = path_of(key);
    ObjectHeader h{};
    std::byte trailing{};
    std::uint64_t payload_bytes = 0;
    for (auto p : pieces) payload_bytes += p.size();
    std::vector<std::span<std::byte>> parts;
    parts.reserve(pieces.size() + 2);
    parts.emplace_back(reinterpret_cast<std::byte*>(&h), sizeof h);
    parts.insert(parts.end(), pieces.begin(), pieces.end());
    parts.emplace_back(&trailing, 1);
    std::size_t read = 0;
    PayloadHasher payload;  // parts[1 .. pieces.size()]: not the header, not the trailing byte
    const int e = fs_->read_file_streamed(path, parts, &read, [&](std::size_t part, std::span<const std::byte> bytes) {
      if (part >= 1 && part <= pieces.size()) payload.update(bytes);
    });
    ObjectResult r;
    std::string error;
    if (e == ENOENT) {
      r = ObjectResult::kMissing;
    } else if (e != 0) {
      r = ObjectResult::kFailed;
      error = "read " + path + ": " + std::strerror(e);
    } else if (read != sizeof h + payload_bytes) {
      r = ObjectResult::kCorrupt;  // truncated, or trailing bytes
    } else {
      r = verify_object(opts_.store, namespaced_key(opts_.store, key), h, payload);
    }
    counters_.count_get(r);
    if (r == ObjectResult::kOk) {
      MutexLock g(mu_);
      touch_locked(path, sizeof h + payload_bytes);
    }
    return {r, std::move(error)};
  }

  // Writes one object (header + payload parts) to a temporary file and renames it in place. The
  // payload goes first, each stretch hashed just before it is written (still in the cache), and
  // the header, sealed with the checksum, last.
  KeyResult write_one(const std::string& key, std::span<const std::span<const std::byte>> payload) {
    const std::string path = path_of(key);
    const std::string dir = path.substr(0, path.rfind('/'));
    const std::string namespaced = namespaced_key(opts_.store, key);
    const std::string tmp = dir + "/" + kTmpPrefix + key + "-" + detail::unique_suffix();
    auto write_tmp = [&] {  // a fresh header and hash each attempt
      ObjectHeader h = header_before_payload(opts_.store, namespaced);
      PayloadHasher hash;
      std::vector<std::span<const std::byte>> parts;
      parts.reserve(payload.size() + 1);
      parts.emplace_back(reinterpret_cast<const std::byte*>(&h), sizeof h);
      parts.insert(parts.end(), payload.begin(), payload.end());
      return fs_->write_file_sealed(
          tmp, parts, opts_.sync != SyncPolicy::kNone, [&](std::span<const std::byte> b) { hash.update(b); },
          [&] { seal_header(h, hash); });
    };
    const char* step = "write ";
    int e = write_tmp();
    if (e == ENOENT && fs_->make_dirs(dir) == 0) {
      // The directory made at open was removed under us (an operator cleaning the store, a
      // tmpfiles rule): make it again instead of failing every later put.
      e = write_tmp();
    }
    if (e == 0) {
      // Eviction picks its victims from the index, so a path being renamed in is marked first and
      // eviction leaves it alone until it is indexed as new (eviction used to remove a concurrent
      // put's fresh object under an old LRU entry). The rename itself runs without the lock: a
      // stalled write must not hold every load's index update (StorageTaskTest.AFileStoreWhose-
      // WritesStallNeverHoldsSwapsOrLoads; the lock used to be held across it).
      step = "rename to ";
      {
        MutexLock g(mu_);
        ++renaming_[path];
      }
      e = fs_->rename(tmp, path);
      MutexLock g(mu_);
      if (--renaming_[path] == 0) renaming_.erase(path);
      if (e == 0) {
        touch_locked(path, sizeof(ObjectHeader) + opts_.store.object_bytes);
        evict_locked(path);
      }
    }
    if (e == 0 && opts_.sync == SyncPolicy::kFull) {
      step = "sync directory of ";
      e = fs_->sync_dir(dir);
    }
    if (e != 0) {
      fs_->remove(tmp);  // the previous object under this key, if any, is untouched
      counters_.count_put(ObjectResult::kFailed);
      return {ObjectResult::kFailed, step + path + ": " + std::strerror(e)};
    }
    counters_.count_put(ObjectResult::kOk);
    return {ObjectResult::kOk, {}};
  }

  Status<StorageErrc> remove(std::span<const std::string> keys) override {
    KVTD_TRY(detail::check_keys(keys));
    for (const auto& k : keys) {
      const std::string path = path_of(k);
      if (int e = fs_->remove(path); e != 0)
        return make_error(StorageErrc::kIo, "remove " + path + ": " + std::strerror(e));
      MutexLock g(mu_);
      forget_locked(path);
    }
    return {};
  }

  Result<GcReport, StorageErrc> collect(const GcRequest& r) override {
    auto rep = detail::collect_files(
        *fs_, opts_.root, kSuffix, opts_.store.model_id, r,
        [this](const std::string& path) EXCLUDES(mu_) {
          MutexLock g(mu_);
          forget_locked(path);  // the capacity accounting follows
        });
    if (!rep.ok() || r.dry_run) return rep;
    // What another daemon sharing the root removed is gone from the walk but still indexed here.
    MutexLock g(mu_);
    std::vector<std::string> stale;
    for (const auto& [path, entry] : index_)
      if (const auto o = detail::parse_stored_path(opts_.root, path, kSuffix))
        if (!gc_keeps(r, opts_.store.model_id, *o)) stale.push_back(path);
    for (const auto& path : stale) forget_locked(path);
    return rep;
  }

  StoreStats stats() const override {
    StoreStats s = counters_.snapshot();
    MutexLock g(mu_);
    s.evictions = evictions_;
    s.bytes_stored = total_;
    s.objects_stored = index_.size();
    s.sized = true;
    return s;
  }

 private:
  struct Entry {
    std::uint64_t bytes;
    std::list<std::string>::iterator lru;
  };

  std::string path_of(const std::string& key) const {
    const std::uint64_t h = hash_bytes(key.data(), key.size());
    char fan[3];
    std::snprintf(fan, sizeof fan, "%02x", static_cast<unsigned>(h & 0xff));
    return dir_ + "/" + fan + "/" + key + kSuffix;
  }

  void touch_locked(const std::string& path, std::uint64_t bytes) REQUIRES(mu_) {
    auto it = index_.find(path);
    if (it != index_.end()) {
      total_ -= it->second.bytes;
      lru_.erase(it->second.lru);
      index_.erase(it);
    }
    lru_.push_front(path);
    index_.emplace(path, Entry{bytes, lru_.begin()});
    total_ += bytes;
  }

  void forget_locked(const std::string& path) REQUIRES(mu_) {
    auto it = index_.find(path);
    if (it == index_.end()) return;
    total_ -= it->second.bytes;
    lru_.erase(it->second.lru);
    index_.erase(it);
  }

  // Removes least-recently-used objects until the total fits the capacity; `keep` (the object
  // just written) and objects being renamed in always stay, even if they alone are larger.
  void evict_locked(const std::string& keep) REQUIRES(mu_) {
    if (opts_.capacity_bytes == 0) return;
    auto it = lru_.end();
    while (total_ > opts_.capacity_bytes && it != lru_.begin()) {
      --it;
      if (*it == keep || renaming_.count(*it) != 0) continue;  // just written, or being renamed in
      const std::string victim = *it;
      it = std::next(it);  // stays valid: forget_locked erases the victim's node only
      fs_->remove(victim);
      forget_locked(victim);
      ++evictions_;
      if (opts_.on_evict) {
        const std::string base = victim.substr(victim.rfind('/') + 1);
        opts_.on_evict(base.substr(0, base.size() - std::strlen(kSuffix)));
      }
    }
  }

  FileStoreOptions opts_;
  std::unique_ptr<FileSystem> owned_fs_;
  FileSystem* fs_;
  std::string dir_;

  mutable Mutex mu_;  // the index; never held across a read, a write or a rename (eviction unlinks under it)
  std::list<std::string> lru_ GUARDED_BY(mu_);  // front: most recently used
  std::unordered_map<std::string, Entry> index_ GUARDED_BY(mu_);
  std::uint64_t total_ GUARDED_BY(mu_) = 0;
  std::uint64_t evictions_ GUARDED_BY(mu_) = 0;
  std::unordered_map<std::string, int> renaming_ GUARDED_BY(mu_);  // paths puts are renaming in, and how many

  detail::Counters counters_;
  std::unique_ptr<detail::DirectObjectReader> direct_;  // --storage-io direct; null: buffered reads
  mutable Mutex scratch_mu_;
  mutable std::vector<std::unique_ptr<std::byte[]>> scratch_free_ GUARDED_BY(scratch_mu_);
  mutable detail::IoPool io_pool_{opts_.io_threads};  // last: its helpers stop before the rest goes
};

}  // namespace

Result<std::unique_ptr<ObjectStore>, StorageErrc> open_file_store(const FileStoreOptions& o) {
  if (!proto::valid_model_id(o.store.model_id))
    return make_error(StorageErrc::kInvalidArgument, "model id '" + o.store.model_id + "' must be 1-64 of [A-Za-z0-9_.-]");
  if (o.store.object_bytes == 0) return make_error(StorageErrc::kInvalidArgument, "object_bytes must be positive");
  if (o.root.empty()) return make_error(StorageErrc::kInvalidArgument, "file store root directory is empty");
  if (!o.fs) {  // the real file system (tests that inject one have no owner or mode to check)
    KVTD_TRY(detail::check_private_root(o.root));
  }
  auto owned = o.fs ? nullptr : make_posix_file_system();
  auto store = std::make_unique<FileStore>(o, std::move(owned));
  KVTD_TRY(store->prepare_dirs());
  KVTD_TRY(store->load_index());
  return std::unique_ptr<ObjectStore>(std::move(store));
}

}  // namespace kvtd::storage
