#include "fastdeploy_ipc.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fmt/format.h>

#include "kvtd/proto/session.h"

namespace kvtd::daemon {
namespace {

const char* fastdeploy_prefix(proto::TensorKind kind) {
  switch (kind) {
    case proto::TensorKind::kKey: return "key_caches_";
    case proto::TensorKind::kValue: return "value_caches_";
    case proto::TensorKind::kKeyScale: return "key_cache_scales_";
    case proto::TensorKind::kValueScale: return "value_cache_scales_";
  }
  return "?";
}

// shm_open's view of a name: glibc maps "x" and "/x" to /dev/shm/x.
std::string shm_path(const std::string& name) { return "/" + name; }

}  // namespace

std::string fastdeploy_tensor_name(proto::TensorKind kind, std::uint32_t layer, std::uint32_t rank,
                                   std::int32_t device_id) {
  return fmt::format("{}{}_rank{}.device{}", fastdeploy_prefix(kind), layer, rank, device_id);
}

Result<proto::TensorDesc, DeviceErrc> read_fastdeploy_tensor(const proto::CacheGeometry& g, std::uint32_t rank,
                                                            std::uint32_t layer, proto::TensorKind kind,
                                                            std::int32_t device_id) {
  const std::string name = fastdeploy_tensor_name(kind, layer, rank, device_id);
  const int fd = shm_open(shm_path(name).c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0)
    return make_error(DeviceErrc::kOpenFailed, "FastDeploy's worker has not published " + name + " (shm_open: " +
                                                   std::strerror(errno) + ")");
  struct stat st {};
  std::uint8_t raw[kFastDeployShmStructBytes];
  const bool sized = fstat(fd, &st) == 0 && st.st_size >= static_cast<off_t>(sizeof raw);
  const ssize_t got = sized ? pread(fd, raw, sizeof raw, 0) : -1;
  const int err = errno;
  close(fd);
  if (!sized)
    return make_error(DeviceErrc::kOpenFailed,
                      fmt::format("/dev/shm/{} holds {} bytes; FastDeploy's set_data_ipc writes {}", name, st.st_size,
                                  sizeof raw));
  if (got != static_cast<ssize_t>(sizeof raw))
    return make_error(DeviceErrc::kOpenFailed, "cannot read /dev/shm/" + name + ": " + std::strerror(err));
  proto::TensorDesc d = proto::describe_tensor(g, rank, layer, kind);
  d.device_id = device_id;
  d.offset = 0;
  std::memcpy(d.handle, raw + kFastDeployHandleOffset, proto::kHandleBytes);
  return d;
}

namespace {

// Writes one set_data_ipc object: nprocesses = 0, then the handle (what FastDeploy's worker reads
// with share_external_data). Mode 0600: FastDeploy's worker runs as the same user.
Status<DeviceErrc> publish_name(const std::string& name, const std::array<std::uint8_t, proto::kHandleBytes>& handle) {
  std::uint8_t raw[kFastDeployShmStructBytes] = {};
  std::memcpy(raw + kFastDeployHandleOffset, handle.data(), handle.size());
  const int fd = shm_open(shm_path(name).c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return make_error(DeviceErrc::kAllocFailed, "cannot create /dev/shm/" + name + ": " + std::strerror(errno));
  const bool ok = pwrite(fd, raw, sizeof raw, 0) == static_cast<ssize_t>(sizeof raw);
  const int err = errno;
  close(fd);
  if (!ok) return make_error(DeviceErrc::kAllocFailed, "cannot write /dev/shm/" + name + ": " + std::strerror(err));
  return {};
}

}  // namespace

Result<std::unique_ptr<FastDeployOwnedCache>, DeviceErrc> FastDeployOwnedCache::create(
    TensorMapper& backend, const proto::CacheGeometry& g, std::uint32_t rank, std::int32_t device_id,
    const std::function<std::string(std::size_t)>& object_name) {
  std::unique_ptr<FastDeployOwnedCache> c(new FastDeployOwnedCache(backend));
  c->tensors_.assign(std::size_t{g.num_layers} * proto::kTensorKinds, nullptr);
  for (const auto [l, kind] : proto::tensors_of(g)) {
    const std::size_t i = std::size_t{l} * proto::kTensorKinds + static_cast<std::uint32_t>(kind);
    const auto bytes = proto::describe_tensor(g, rank, l, kind).bytes;
    KVTD_ASSIGN_OR_RETURN(auto t, backend.create_exported(bytes, object_name(i)));
    const std::string name = fastdeploy_tensor_name(kind, l, rank, device_id);
    KVTD_TRY(publish_name(name, t.handle));
    c->names_.push_back(name);
    c->tensors_[i] = t.ptr;
  }
  return c;
}

FastDeployOwnedCache::~FastDeployOwnedCache() {
  for (const auto& n : names_) shm_unlink(shm_path(n).c_str());
  backend_.free_exported();
}

std::byte* FastDeployOwnedCache::tensor(std::uint32_t layer, proto::TensorKind kind) const {
  const std::size_t i = std::size_t{layer} * proto::kTensorKinds + static_cast<std::size_t>(kind);
  return i < tensors_.size() ? tensors_[i] : nullptr;
}

Result<FastDeploySignal, DeviceErrc> FastDeploySignal::open(const std::string& name, const std::string& suffix,
                                                            std::size_t min_elements) {
  const std::string full = name + "." + suffix;
  const int fd = shm_open(shm_path(full).c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0)
    return make_error(DeviceErrc::kOpenFailed, "FastDeploy signal " + full + " does not exist yet (shm_open: " +
                                                   std::strerror(errno) + ")");
  struct stat st {};
  const std::size_t need = min_elements * sizeof(std::int32_t);
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(need)) {
    close(fd);
    return make_error(DeviceErrc::kOpenFailed,
                      fmt::format("FastDeploy signal /dev/shm/{} holds {} bytes; {} expected ({} int32)", full,
                                  st.st_size, need, min_elements));
  }
  void* p = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) return make_error(DeviceErrc::kOpenFailed, "cannot map /dev/shm/" + full + ": " + std::strerror(err));
  return FastDeploySignal(full, p, need);
}

FastDeploySignal::FastDeploySignal(FastDeploySignal&& o) noexcept
    : name_(std::move(o.name_)), base_(o.base_), bytes_(o.bytes_) {
  o.base_ = nullptr;
}

FastDeploySignal& FastDeploySignal::operator=(FastDeploySignal&& o) noexcept {
  if (this != &o) {
    if (base_ != nullptr) munmap(base_, bytes_);
    name_ = std::move(o.name_);
    base_ = o.base_;
    bytes_ = o.bytes_;
    o.base_ = nullptr;
  }
  return *this;
}

FastDeploySignal::~FastDeploySignal() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

// numpy writes these words with plain stores from other processes; an atomic_ref of a naturally
// aligned int32 (the object is page-aligned) reads a whole value without tearing.
std::int32_t FastDeploySignal::load(std::size_t i) const {
  if ((i + 1) * sizeof(std::int32_t) > bytes_) return 0;
  return std::atomic_ref<std::int32_t>(static_cast<std::int32_t*>(base_)[i]).load(std::memory_order_acquire);
}

void FastDeploySignal::store(std::size_t i, std::int32_t v) {
  if ((i + 1) * sizeof(std::int32_t) > bytes_) return;
  std::atomic_ref<std::int32_t>(static_cast<std::int32_t*>(base_)[i]).store(v, std::memory_order_release);
}

}  // namespace kvtd::daemon
