// kvtd/storage/file_system.h - the file operations the file store needs, behind an interface so
// tests can inject ENOSPC, EACCES and short writes (LevelDB's Env idea).
//
// Thread-safety: implementations must be safe to call from several threads.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kvtd::storage {

// O_DIRECT reads need buffers, offsets and lengths aligned to the device's logical block; 4096
// covers every common one.
inline constexpr std::size_t kDirectAlign = 4096;

// One whole-file read of a direct batch: the path, a buffer (kDirectAlign-aligned, a multiple
// of it long) and what came back.
struct DirectRead {
  std::string path;
  std::span<std::byte> buffer;
  int error = 0;          // 0 or an errno (ENOENT: missing)
  std::size_t bytes = 0;  // read from offset 0; less than the buffer at end of file
};

struct FileEntry {
  std::string path;
  std::uint64_t bytes;
  std::int64_t mtime_ns;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // Each returns 0 or an errno value.
  // Creates `path` (truncating), writes the parts in order, optionally fsyncs, closes.
  virtual int write_file(const std::string& path, std::span<const std::span<const std::byte>> parts, bool sync) = 0;
  // Reads up to the parts' sizes into them; *read gets the bytes actually read (short = truncated).
  virtual int read_file(const std::string& path, std::span<const std::span<std::byte>> parts, std::size_t* read) = 0;
  // A stretch of parts[part] that a streamed read has just filled.
  using Filled = std::function<void(std::size_t part, std::span<const std::byte> bytes)>;
  // Like read_file, and calls on_filled with each stretch of the parts as it is read, in file
  // order, so the caller can hash the bytes while they are still in the CPU's cache. The default
  // reads whole with read_file, then reports each part's filled prefix.
  virtual int read_file_streamed(const std::string& path, std::span<const std::span<std::byte>> parts,
                                 std::size_t* read, const Filled& on_filled);
  // A stretch of an object's payload about to be written.
  using Writing = std::function<void(std::span<const std::byte> bytes)>;
  // Like write_file, for an object whose first part (its header) depends on the others: writes
  // parts[1..] first, from offset parts[0].size(), in writes of a bounded size, calling on_write
  // with each stretch just before it is written (the file store hashes it there, while it is in
  // the cache), then seal(), then parts[0] at offset 0; optionally fsyncs, closes. The default
  // calls on_write with each part whole, then seal(), then write_file.
  virtual int write_file_sealed(const std::string& path, std::span<const std::span<const std::byte>> parts, bool sync,
                                const Writing& on_write, const std::function<void()>& seal);
  virtual int rename(const std::string& from, const std::string& to) = 0;
  virtual int remove(const std::string& path) = 0;
  virtual int exists(const std::string& path, bool* present) = 0;
  virtual int make_dirs(const std::string& path) = 0;
  virtual int sync_dir(const std::string& path) = 0;
  // Every regular file under `root`, recursively.
  virtual int list_files(const std::string& root, std::vector<FileEntry>* out) = 0;
  // Reads each file from offset 0 with O_DIRECT (past the page cache) into its buffer, several in
  // flight; each read gets its own error and byte count. Returns 0, or an errno when the batch
  // could not be attempted at all. The default refuses (EOPNOTSUPP).
  virtual int read_direct(std::span<DirectRead> reads) {
    (void)reads;
    return EOPNOTSUPP;
  }
};

std::unique_ptr<FileSystem> make_posix_file_system();

}  // namespace kvtd::storage
