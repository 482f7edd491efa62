// kvtd/storage/file_system.h - the file operations the file store needs, behind an interface so
// tests can inject ENOSPC, EACCES and short writes (LevelDB's Env idea).
//
// Thread-safety: implementations must be safe to call from several threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kvtd::storage {

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
  virtual int rename(const std::string& from, const std::string& to) = 0;
  virtual int remove(const std::string& path) = 0;
  virtual int exists(const std::string& path, bool* present) = 0;
  virtual int make_dirs(const std::string& path) = 0;
  virtual int sync_dir(const std::string& path) = 0;
  // Every regular file under `root`, recursively.
  virtual int list_files(const std::string& root, std::vector<FileEntry>* out) = 0;
};

std::unique_ptr<FileSystem> make_posix_file_system();

}  // namespace kvtd::storage
