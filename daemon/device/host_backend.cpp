// Host device backend: "device" tensors are shared-memory objects created by the engine side, or an
// engine's own memory named by its descriptor (/proc/<pid>/fd/<fd>: sglang's memfd host pool),
// taken from the engine with pidfd_getfd.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fmt/format.h>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bus_error_guard.h"
#include "kvtd/daemon/device_backend.h"
#include "kvtd/daemon/engine_memory.h"
#include "kvtd/ipc/populate.h"
#include "kvtd/ipc/process.h"
#include "kvtd/kernels/checksum.h"
#include "kvtd/ipc/shared_object.h"

namespace kvtd::daemon {
namespace {

// The task's error when the engine shrank the memory under a copy (bus_error_guard.h).
Error<DeviceErrc> shrunk_under_copy(const char* what, std::uintptr_t fault) {
  char addr[32];
  std::snprintf(addr, sizeof addr, "%#llx", static_cast<unsigned long long>(fault));
  return make_error(DeviceErrc::kCopyFailed,
                    std::string(what) + ": bus error at " + addr +
                        ": the engine's memory shrank below what it registered (its file was truncated after "
                        "attach); the copy stopped, nothing after the fault was written");
}

// Runs `copy` (plain memcpy loops over engine memory) and turns a bus error into a failed status.
template <typename F>
Status<DeviceErrc> guarded(const char* what, F&& copy) {
  if (const auto fault = survive_bus_error(copy)) return shrunk_under_copy(what, *fault);
  return {};
}

}  // namespace

Result<std::vector<std::uint64_t>, DeviceErrc> CopyEngine::device_checksums(Direction dir,
                                                                            std::span<const kernels::CopyTarget> targets,
                                                                            std::span<const std::int32_t> ids) {
  std::vector<std::uint64_t> out;
  out.reserve(targets.size() * ids.size());  // no allocation below: the guard may cut the loop short
  auto st = guarded("checksums of the engine's blocks", [&] {
    for (const auto& t : targets) {
      const std::byte* base = dir == Direction::kToHost ? t.src : t.dst;
      const std::uint64_t stride = dir == Direction::kToHost ? t.src_stride : t.dst_stride;
      for (auto id : ids)
        out.push_back(kernels::block_checksum(base + static_cast<std::uint64_t>(id) * stride, t.block_bytes));
    }
  });
  if (!st.ok()) return std::move(st).error();
  return out;
}

Result<std::vector<std::uint64_t>, DeviceErrc> CopyEngine::copy_with_checksums(Direction dir, const kernels::CopyPlan& plan,
                                                                               std::span<const kernels::CopyTarget> targets,
                                                                               std::span<const std::int32_t> ids) {
  KVTD_TRY(copy(dir, plan, targets));
  if (ids.empty()) return std::vector<std::uint64_t>{};
  return device_checksums(dir, targets, ids);
}

Status<DeviceErrc> CopyEngine::copy_layerwise_checked(Direction dir, const kernels::CopyPlan& plan,
                                                      std::span<const kernels::CopyTarget> targets,
                                                      std::size_t targets_per_layer, std::span<const std::int32_t> ids,
                                                      const LayerCallback& on_layer_enqueued,
                                                      const CheckedLayer& on_layer_checked) {
  std::optional<Error<DeviceErrc>> failed;  // a layer's checksums could not be taken: the rest are not
  auto st = copy_layerwise(dir, plan, targets, targets_per_layer, on_layer_enqueued, [&](std::uint32_t layer) {
    if (failed) return;
    const std::size_t first = std::size_t{layer} * targets_per_layer;
    const auto layer_targets = targets.subspan(first, std::min(targets_per_layer, targets.size() - first));
    auto sums = device_checksums(dir, layer_targets, ids);
    if (!sums.ok()) {
      failed = std::move(sums).error();
      return;
    }
    if (on_layer_checked) on_layer_checked(layer, *sums);
  });
  if (!st.ok()) return st;
  if (failed) return std::move(*failed);
  return {};
}

namespace {

// One opened "device" object, mapped whole; unmapped on destruction. Move-only.
struct Mapping {
  void* addr = nullptr;
  std::size_t size = 0;

  Mapping(void* a, std::size_t n) : addr(a), size(n) {}
  Mapping(Mapping&& o) noexcept : addr(std::exchange(o.addr, nullptr)), size(o.size) {}
  Mapping& operator=(Mapping&&) = delete;
  Mapping(const Mapping&) = delete;
  ~Mapping() {
    if (addr) munmap(addr, size);
  }
};

// "/proc/<pid>/fd/<fd>" with both numbers plain digits: the pid and fd, else nullopt.
std::optional<std::pair<std::uint32_t, std::uint32_t>> parse_engine_fd(std::string_view handle) {
  const auto number = [](std::string_view s) -> std::optional<std::uint32_t> {
    if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return std::nullopt;
    return static_cast<std::uint32_t>(std::stoul(std::string(s)));
  };
  constexpr std::string_view kProc = "/proc/", kFd = "/fd/";
  if (handle.substr(0, kProc.size()) != kProc) return std::nullopt;
  handle.remove_prefix(kProc.size());
  const std::size_t at = handle.find(kFd);
  if (at == std::string_view::npos) return std::nullopt;
  const auto pid = number(handle.substr(0, at)), fd = number(handle.substr(at + kFd.size()));
  if (!pid || !fd) return std::nullopt;
  return std::pair{*pid, *fd};
}

// "" when the engine's own descriptor `pid_fd` is open read-write on the file the daemon opened
// (`opened`, fstat'd), else why not: from /proc/<pid>/fdinfo/<fd>, read after the daemon's open,
// the description's flags (octal) and, where the kernel says it, its inode (the engine may have
// put another file under the number between the two).
std::string engine_fd_problem(std::pair<std::uint32_t, std::uint32_t> pid_fd, const struct stat& opened) {
  const std::string info = fmt::format("/proc/{}/fdinfo/{}", pid_fd.first, pid_fd.second);
  std::FILE* f = std::fopen(info.c_str(), "re");
  if (f == nullptr) return "cannot be checked: " + info + ": " + std::strerror(errno);
  char line[256];
  long flags = -1;
  long long inode = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, "flags:", 6) == 0) flags = std::strtol(line + 6, nullptr, 8);
    if (std::strncmp(line, "ino:", 4) == 0) inode = std::strtoll(line + 4, nullptr, 10);
  }
  std::fclose(f);
  if (flags < 0) return "cannot be checked: " + info + " names no flags";
  if (inode >= 0 && static_cast<unsigned long long>(inode) != static_cast<unsigned long long>(opened.st_ino))
    return "changed under the daemon while it was opened (another file under the same descriptor number)";
  if ((flags & O_ACCMODE) != O_RDWR)
    return "is open read-only in the engine: a daemon writes only what the engine itself may write";
  return "";
}

// Whether `fd` is a memfd: its name says so and, as only memory does, it answers F_GET_SEALS.
bool is_memfd(int fd) {
  char link[64] = {};
  const std::string self = fmt::format("/proc/self/fd/{}", fd);
  const ssize_t n = readlink(self.c_str(), link, sizeof link - 1);
  return n > 0 && std::string_view(link, static_cast<std::size_t>(n)).substr(0, 7) == "/memfd:" &&
         fcntl(fd, F_GET_SEALS) >= 0;
}

// The engine's memory /proc/<pid>/fd/<fd> opened for mapping: the engine's own descriptor taken
// (ipc::take_process_descriptor), or, where the kernel will not give it, the file reopened through /proc
// and held to the engine's own open mode (engine_fd_problem). Then it must be a memfd: memory the
// engine made, never a disk or tmpfs file it happens to hold (someone's data). -1 and `why`.
int open_engine_memory(const std::string& name, std::string& why) {
  const auto pid_fd = *parse_engine_fd(name);
  // The engine's own descriptor (its access mode, whatever this daemon's rights); EPERM and ENOSYS
  // (see ipc::take_process_descriptor) fall back to reopening it through /proc.
  int fd = ipc::take_process_descriptor(static_cast<int>(pid_fd.first), static_cast<int>(pid_fd.second));
  const bool taken = fd >= 0;
  if (!taken && errno != EPERM && errno != ENOSYS) {
    why = std::string("cannot take it from the engine: ") + std::strerror(errno);
    return -1;
  }
  if (!taken) fd = ::open(name.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    why = std::string("cannot open it: ") + std::strerror(errno) +
          (errno == EACCES ? " (the daemon must run as the engine's user)" : "");
    return -1;
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0)
    why = "is not a non-empty memfd or file";
  else if (!taken)
    why = engine_fd_problem(pid_fd, st);
  else if ((fcntl(fd, F_GETFL) & O_ACCMODE) != O_RDWR)
    why = "is open read-only in the engine: a daemon writes only what the engine itself may write";
  if (why.empty() && !is_memfd(fd))
    why = "is not shared memory the engine made (a memfd): a daemon maps no other file the engine holds";
  if (!why.empty()) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Opens and maps a "device" object read-write: a /dev/shm object by its name, or an engine's own
// memory by /proc/<pid>/fd/<fd> (a memfd: sglang's host pool with "allocator": "shm",
// mem_cache/storage/mmap/mmap_allocator.py:160-167 at v0.5.18; open_engine_memory). Only a
// non-empty regular file is mapped; a name holding '/' past a leading one, or a malformed /proc
// form, is refused by name.
Result<Mapping, DeviceErrc> map_object(const std::string& name) {
  const bool engine_fd = name.rfind("/proc/", 0) == 0;
  const std::string_view bare = std::string_view(name).substr(!name.empty() && name[0] == '/' ? 1 : 0);
  if (engine_fd ? !parse_engine_fd(name) : bare.find('/') != std::string_view::npos)
    return make_error(DeviceErrc::kOpenFailed, "device tensor object " + name +
                                                   " is neither a shared-memory object name nor /proc/<pid>/fd/<fd>");
  const std::string what = engine_fd ? "the engine's memory " + name : "device tensor object " + name;
  int fd = -1;
  if (engine_fd) {
    std::string why;
    fd = open_engine_memory(name, why);
    if (fd < 0) return make_error(DeviceErrc::kOpenFailed, what + " " + why);
  } else {
    fd = ::open(("/dev/shm/" + std::string(bare)).c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0)
      return make_error(DeviceErrc::kOpenFailed, "cannot open " + what + ": " + std::strerror(errno) +
                                                     (errno == EACCES ? " (the daemon must run as the engine's user)" : ""));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0) {
    ::close(fd);
    return make_error(DeviceErrc::kOpenFailed, what + " is not a non-empty memfd or file");
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    return make_error(DeviceErrc::kOpenFailed,
                      fmt::format("cannot map {} ({} bytes): {}", what, size, std::strerror(mmap_errno)));
  return Mapping(p, size);
}

}  // namespace

std::optional<std::uint32_t> engine_memory_pid(std::string_view handle) {
  const auto parsed = parse_engine_fd(handle);
  return parsed ? std::optional<std::uint32_t>(parsed->first) : std::nullopt;
}

namespace {

class HostBackend final : public DeviceBackend {
 public:
  ~HostBackend() override {
    close_tensors();
    for (auto& [p, n] : host_) munmap(p, n);
  }

  bool tensors_host_accessible() const override { return true; }
  const char* name() const override { return "host"; }

  Result<std::byte*, DeviceErrc> open_tensor(const proto::TensorDesc& d) override {
    const auto* raw = reinterpret_cast<const char*>(d.handle);
    const std::size_t len = strnlen(raw, sizeof d.handle);
    if (len == 0 || len == sizeof d.handle)
      return make_error(DeviceErrc::kOpenFailed, "tensor handle is not a shared-memory object name");
    const std::string name(raw, len);
    auto it = maps_.find(name);
    if (it == maps_.end()) {
      KVTD_ASSIGN_OR_RETURN(Mapping opened, map_object(name));
      ipc::populate_for_write(opened.addr, opened.size);
      it = maps_.emplace(name, std::move(opened)).first;
    }
    const Mapping& m = it->second;
    if (d.offset > m.size || d.bytes > m.size - d.offset)
      return make_error(DeviceErrc::kOpenFailed,
                        fmt::format("tensor at offset {} of {} bytes exceeds object {} of {} bytes", d.offset,
                                    d.bytes, name, m.size));
    return static_cast<std::byte*>(m.addr) + d.offset;
  }

  void close_tensors() override { maps_.clear(); }

  Result<std::byte*, DeviceErrc> alloc_host(std::size_t bytes) override {
    if (bytes == 0) return static_cast<std::byte*>(nullptr);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
      return make_error(DeviceErrc::kAllocFailed,
                        fmt::format("cannot allocate {} bytes of host pool: {}", bytes, std::strerror(errno)));
    host_.emplace_back(p, bytes);
    return static_cast<std::byte*>(p);
  }

  void free_host(std::byte* ptr) override {
    for (auto it = host_.begin(); it != host_.end(); ++it)
      if (it->first == ptr) {
        munmap(it->first, it->second);
        host_.erase(it);
        return;
      }
  }

  Status<DeviceErrc> pin_host(std::byte*, std::size_t) override { return {}; }  // nothing to pin on the CPU
  void unpin_host(std::byte*) override {}
  bool pins_memory() const override { return false; }

  Status<DeviceErrc> copy(Direction, const kernels::CopyPlan& plan,
                          std::span<const kernels::CopyTarget> targets) override {
    return guarded("swap", [&] { kernels::copy_all_host(plan, targets); });
  }

  Status<DeviceErrc> copy_layerwise(Direction, const kernels::CopyPlan& plan,
                                    std::span<const kernels::CopyTarget> targets, std::size_t targets_per_layer,
                                    const LayerCallback& on_layer_enqueued, const LayerCallback& on_layer_done) override {
    // memcpy is synchronous: a layer is queued and complete at the same moment. Layers reported
    // before a bus error were copied whole; the task still fails.
    const std::function<void(std::uint32_t)> each_layer = [&](std::uint32_t layer) {
      if (on_layer_enqueued) on_layer_enqueued(layer);
      if (on_layer_done) on_layer_done(layer);
    };
    return guarded("layer-by-layer swap",
                   [&] { kernels::copy_layerwise_host(plan, targets, targets_per_layer, each_layer); });
  }

  Result<std::vector<std::array<std::uint8_t, proto::kHandleBytes>>, DeviceErrc> export_layer_events(
      std::uint32_t) override {
    return std::vector<std::array<std::uint8_t, proto::kHandleBytes>>{};
  }

  Status<DeviceErrc> gather_to_staging(std::span<const kernels::LayerTensor> tensors,
                                       std::span<const std::int32_t> ids, std::byte* staging) override {
    return guarded("gather for storage", [&] { kernels::gather_to_staging_host(tensors, ids, staging); });
  }

  Status<DeviceErrc> scatter_from_staging(std::span<const kernels::LayerTensor> tensors,
                                          std::span<const std::int32_t> ids, const std::byte* staging) override {
    return guarded("scatter from storage", [&] { kernels::scatter_from_staging_host(tensors, ids, staging); });
  }

  // A shared-memory object the other process opens by name, as the engine's arenas are.
  Result<ExportedTensor, DeviceErrc> create_exported(std::size_t bytes, const std::string& object_name) override {
    ExportedTensor t;
    if (object_name.empty() || object_name.size() >= t.handle.size())
      return make_error(DeviceErrc::kAllocFailed, "exported object name '" + object_name + "' must be 1-63 characters");
    ipc::SharedObject::remove(object_name);  // a previous daemon's, not unlinked when it died
    auto obj = ipc::SharedObject::create(object_name, bytes);
    if (!obj.ok())
      return make_error(DeviceErrc::kAllocFailed, "cannot create " + object_name + ": " + obj.error().message);
    (*obj)->set_unlink_on_destroy(true);
    t.ptr = (*obj)->data();
    std::memcpy(t.handle.data(), object_name.data(), object_name.size());
    exported_.push_back(std::move(obj).value());
    return t;
  }

  void free_exported() override { exported_.clear(); }

  // "Device" memory of the host backend is host memory.
  Result<std::byte*, DeviceErrc> alloc_device(std::size_t bytes) override { return alloc_host(bytes); }

  Status<DeviceErrc> write_device(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    return guarded("write", [&] { std::memcpy(dst, src, bytes); });
  }

  Status<DeviceErrc> read_device(std::byte* dst, const std::byte* src, std::size_t bytes) override {
    return guarded("read", [&] { std::memcpy(dst, src, bytes); });
  }

 private:
  std::map<std::string, Mapping> maps_;
  std::vector<std::pair<void*, std::size_t>> host_;
  std::vector<std::unique_ptr<ipc::SharedObject>> exported_;
};

}  // namespace

std::unique_ptr<DeviceBackend> make_host_backend() { return std::make_unique<HostBackend>(); }

}  // namespace kvtd::daemon
