// forwarding_file_system.h - the storage tests' one file-system double: every call goes to the
// real (POSIX) file system; a test derives from it and overrides only the calls it fails, counts
// or hides. Thread-safety: as the real one (tests add their own state).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvtd/storage/file_system.h"

namespace kvtd::test {

class ForwardingFileSystem : public storage::FileSystem {
 public:
  std::unique_ptr<storage::FileSystem> real = storage::make_posix_file_system();

  int write_file(const std::string& p, std::span<const std::span<const std::byte>> parts, bool sync) override {
    return real->write_file(p, parts, sync);
  }
  int write_file_sealed(const std::string& p, std::span<const std::span<const std::byte>> parts, bool sync,
                        const Writing& on_write, const std::function<void()>& seal) override {
    return real->write_file_sealed(p, parts, sync, on_write, seal);
  }
  int read_file(const std::string& p, std::span<const std::span<std::byte>> parts, std::size_t* n) override {
    return real->read_file(p, parts, n);
  }
  int read_file_streamed(const std::string& p, std::span<const std::span<std::byte>> parts, std::size_t* n,
                         const Filled& on_filled) override {
    return real->read_file_streamed(p, parts, n, on_filled);
  }
  int rename(const std::string& a, const std::string& b) override { return real->rename(a, b); }
  int remove(const std::string& p) override { return real->remove(p); }
  int exists(const std::string& p, bool* present) override { return real->exists(p, present); }
  int make_dirs(const std::string& p) override { return real->make_dirs(p); }
  int sync_dir(const std::string& p) override { return real->sync_dir(p); }
  int list_files(const std::string& r, std::vector<storage::FileEntry>* out) override { return real->list_files(r, out); }
  int read_direct(std::span<storage::DirectRead> reads) override { return real->read_direct(reads); }
};

}  // namespace kvtd::test
