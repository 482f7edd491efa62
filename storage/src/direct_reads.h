// Internal: the file store's O_DIRECT load path (--storage-io direct). Each object is read whole,
// past the page cache, into an aligned buffer of its own (from a free list, so buffers stay
// allocated and faulted in), a bounded number in flight per calling thread; each image is
// verified whole (verify_object_image) before its payload is handed on, so a corrupt, truncated,
// padded or foreign object never reaches the caller.
//
// Thread-safety: read() and probe() from any number of threads. Not copyable.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/storage/file_system.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::storage::detail {

class DirectObjectReader {
 public:
  // Called for each object that verified, with its payload (valid during the call only).
  using OnObject = std::function<void(std::size_t, std::span<const std::byte>)>;

  DirectObjectReader(FileSystem& fs, const StoreOptions& o);
  DirectObjectReader(const DirectObjectReader&) = delete;
  DirectObjectReader& operator=(const DirectObjectReader&) = delete;

  // Whether `dir` takes O_DIRECT reads; the error names `root` and says what to do instead.
  Status<StorageErrc> check_directory(const std::string& dir, const std::string& root);

  // Reads object i from paths[i] (stored under namespaced[i]). Results per object; for kFailed,
  // errors[i] holds the errno. Returns an errno instead when the batch could not run at all.
  int read(std::span<const std::string> paths, std::span<const std::string> namespaced, const OnObject& on_ok,
           std::vector<ObjectResult>& results, std::vector<int>& errors);

  // Whether directory `dir` takes O_DIRECT reads: writes a probe file there, reads it back the
  // direct way, removes it. 0 or an errno (EINVAL: the file system refuses O_DIRECT, e.g. tmpfs).
  int probe(const std::string& dir);

  // The aligned buffer one object is read into: header, payload and one byte more (an object
  // with trailing bytes is not ours), rounded up to kDirectAlign.
  std::size_t buffer_bytes() const { return buffer_bytes_; }

 private:
  struct FreeDeleter {
    void operator()(std::byte* p) const;
  };
  using Buffer = std::unique_ptr<std::byte[], FreeDeleter>;
  Buffer take_buffer();
  void give_back(Buffer b);

  FileSystem& fs_;
  StoreOptions opts_;
  std::size_t buffer_bytes_;
  std::size_t window_;  // objects in flight per call: about 8 MiB of buffers, 1 to the ring depth
  Mutex mu_;
  std::vector<Buffer> free_ GUARDED_BY(mu_);
};

}  // namespace kvtd::storage::detail
