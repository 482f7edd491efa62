// kvtd/storage/file_store.h - the embedded default storage backend: a directory on local disk.
//
// Layout: <root>/<model_id>/<fingerprint hex>/<2 hex fan-out>/<key>.kvo. put() writes a
// temporary file in the same directory and renames it over the final name, so a crash never
// leaves a torn object visible and concurrent puts of one key leave one whole object. A capacity
// limit evicts least-recently-used objects (recency: put and successful get; at open, file
// mtime). Temporary files left by a crash are removed at open.
//
// The capacity is enforced over the objects this instance knows (those present at open plus its
// own puts); exists() and get() always look at the disk, so objects written by other processes
// are found. Thread-safety: all methods may be called concurrently.
#pragma once

#include "kvtd/storage/file_system.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::storage {

enum class SyncPolicy {
  kNone,  // leave durability to the page cache (fastest; a crash may lose recent objects)
  kData,  // fsync each object before its rename
  kFull,  // also fsync the directory after the rename
};

struct FileStoreOptions {
  StoreOptions store;
  std::string root;
  std::uint64_t capacity_bytes = 0;  // 0: unlimited
  SyncPolicy sync = SyncPolicy::kNone;
  unsigned io_threads = 2;           // threads one batch is spread over (object creation is CPU-bound)
  FileSystem* fs = nullptr;          // not owned; null: the real POSIX file system
  // Loads read each object with O_DIRECT (io_uring, several in flight) into an aligned buffer and
  // verify it there, past the page cache; writes stay buffered. open_file_store fails, naming
  // the root, where the file system refuses O_DIRECT (tmpfs, some overlays).
  bool direct_reads = false;
  // Called with the key of each object the capacity LRU evicts, on the thread that evicts it and
  // with the store's index locked: it must be quick and must not call the store (KV events
  // queue it). Empty: not called.
  std::function<void(const std::string& key)> on_evict;
};

Result<std::unique_ptr<ObjectStore>, StorageErrc> open_file_store(const FileStoreOptions& options);

}  // namespace kvtd::storage
