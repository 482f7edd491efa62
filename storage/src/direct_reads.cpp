#include "direct_reads.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <new>

#include "kvtd/storage/object_format.h"
#include "uring_reads.h"

namespace kvtd::storage::detail {

namespace {
constexpr std::size_t kBytesInFlight = 8u << 20;
}

void DirectObjectReader::FreeDeleter::operator()(std::byte* p) const { std::free(p); }

DirectObjectReader::DirectObjectReader(FileSystem& fs, const StoreOptions& o)
    : fs_(fs),
      opts_(o),
      buffer_bytes_((sizeof(ObjectHeader) + o.object_bytes + 1 + kDirectAlign - 1) / kDirectAlign * kDirectAlign),
      window_(std::clamp<std::size_t>(kBytesInFlight / buffer_bytes_, 1, kUringDepth)) {}

DirectObjectReader::Buffer DirectObjectReader::take_buffer() {
  {
    MutexLock g(mu_);
    if (!free_.empty()) {
      Buffer b = std::move(free_.back());
      free_.pop_back();
      return b;
    }
  }
  void* p = std::aligned_alloc(kDirectAlign, buffer_bytes_);
  if (p == nullptr) throw std::bad_alloc();
  return Buffer(static_cast<std::byte*>(p));
}

void DirectObjectReader::give_back(Buffer b) {
  MutexLock g(mu_);
  free_.push_back(std::move(b));
}

Status<StorageErrc> DirectObjectReader::check_directory(const std::string& dir, const std::string& root) {
  if (const int e = probe(dir); e != 0)
    return make_error(StorageErrc::kInvalidArgument,
                      "direct reads (O_DIRECT) are refused under " + root + ": " + std::strerror(e) +
                          (e == EINVAL ? " (the file system does not support O_DIRECT, e.g. tmpfs)" : "") +
                          "; use buffered reads (--storage-io buffered)");
  return {};
}

int DirectObjectReader::read(std::span<const std::string> paths, std::span<const std::string> namespaced,
                             const OnObject& on_ok, std::vector<ObjectResult>& results, std::vector<int>& errors) {
  results.assign(paths.size(), ObjectResult::kMissing);
  errors.assign(paths.size(), 0);
  std::vector<Buffer> buffers;
  for (std::size_t at = 0; at < paths.size(); at += window_) {
    const std::size_t n = std::min(window_, paths.size() - at);
    while (buffers.size() < n) buffers.push_back(take_buffer());
    std::vector<DirectRead> reads(n);
    for (std::size_t j = 0; j < n; ++j) {
      reads[j].path = paths[at + j];
      reads[j].buffer = {buffers[j].get(), buffer_bytes_};
    }
    if (const int e = fs_.read_direct(reads); e != 0) {
      for (auto& b : buffers) give_back(std::move(b));
      return e;
    }
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t i = at + j;
      if (reads[j].error == ENOENT) continue;  // missing
      if (reads[j].error != 0) {
        results[i] = ObjectResult::kFailed;
        errors[i] = reads[j].error;
        continue;
      }
      const std::span<const std::byte> image(buffers[j].get(), reads[j].bytes);
      results[i] = verify_object_image(opts_, namespaced[i], image);
      if (results[i] == ObjectResult::kOk && on_ok) on_ok(i, image.subspan(sizeof(ObjectHeader)));
    }
  }
  for (auto& b : buffers) give_back(std::move(b));
  return 0;
}

int DirectObjectReader::probe(const std::string& dir) {
  // A temporary's name: a crash between write and remove leaves it to the store's clean-up.
  const std::string path = fmt::format("{}/.tmp-direct-probe-{}-0-0", dir, ::getpid());
  std::vector<std::byte> bytes(kDirectAlign, std::byte{0x5a});
  const std::span<const std::byte> part[1] = {bytes};
  if (const int e = fs_.write_file(path, part, false); e != 0) return e;
  Buffer b = take_buffer();
  DirectRead one[1];
  one[0].path = path;
  one[0].buffer = {b.get(), buffer_bytes_};
  int e = fs_.read_direct(one);
  if (e == 0) e = one[0].error;
  if (e == 0 && (one[0].bytes != kDirectAlign || std::memcmp(b.get(), bytes.data(), kDirectAlign) != 0)) e = EIO;
  give_back(std::move(b));
  fs_.remove(path);
  return e;
}

}  // namespace kvtd::storage::detail
