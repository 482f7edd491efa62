#include "kvtd/ipc/segment.h"

#include "kvtd/ipc/clock.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <ctime>

#include "kvtd/proto/checked.h"

namespace kvtd::ipc {

namespace {


std::string mib(std::uint64_t b) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

std::string path_in(const std::string& dir, const std::string& name) { return dir + "/" + name; }

// An object's file: shm_open in /dev/shm, or a plain file in `dir` (never through a symlink).
int open_object(const std::string& name, const std::string& dir, int flags, mode_t mode) {
  if (dir.empty()) return shm_open(name.c_str(), flags, mode);
  if (name.find('/') != std::string::npos) {
    errno = EINVAL;
    return -1;
  }
  return ::open(path_in(dir, name).c_str(), flags | O_NOFOLLOW, mode);
}

// What the place an object is created in has left, for an allocation's error message.
std::string room_of(const std::string& dir) {
  if (dir.empty()) {
    const std::int64_t free_now = shm_free_bytes();
    return "/dev/shm has " + (free_now < 0 ? std::string("unknown") : mib(static_cast<std::uint64_t>(free_now))) + " free";
  }
  struct statvfs v {};
  if (statvfs(dir.c_str(), &v) != 0) return dir + ": " + std::strerror(errno);
  const std::int64_t pages = free_huge_pages(v.f_bsize);
  return dir + " has pages of " + std::to_string(v.f_bsize >> 10) + " kB; the kernel has " +
         (pages < 0 ? std::string("an unknown number of") : std::to_string(pages)) + " of that size free";
}

}  // namespace

std::int64_t free_huge_pages(std::uint64_t page_bytes) {
  const std::string at = "/sys/kernel/mm/hugepages/hugepages-" + std::to_string(page_bytes >> 10) + "kB/";
  auto read_count = [&](const char* file) -> std::int64_t {
    FILE* f = std::fopen((at + file).c_str(), "r");
    if (f == nullptr) return -1;
    long long v = -1;
    if (std::fscanf(f, "%lld", &v) != 1) v = -1;
    std::fclose(f);
    return v;
  };
  const std::int64_t free_pages = read_count("free_hugepages"), reserved = read_count("resv_hugepages");
  if (free_pages < 0 || reserved < 0) return -1;
  return std::max<std::int64_t>(0, free_pages - reserved);
}

std::string session_object_name(std::uint64_t generation, const std::string& what) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "kvtd_%u_%016" PRIx64 "_%s", static_cast<unsigned>(getuid()), generation, what.c_str());
  return buf;
}

std::int64_t shm_free_bytes() {
  struct statvfs v {};
  if (statvfs("/dev/shm", &v) != 0) return -1;
  return static_cast<std::int64_t>(v.f_bavail) * static_cast<std::int64_t>(v.f_frsize);
}

SharedObject::~SharedObject() {
  if (data_ != nullptr) munmap(data_, size_);
  if (unlink_) remove(name_, dir_);
}

void SharedObject::remove(const std::string& name, const std::string& dir) {
  if (dir.empty()) {
    shm_unlink(name.c_str());
  } else if (name.find('/') == std::string::npos) {
    ::unlink(path_in(dir, name).c_str());
  }
}

Result<std::unique_ptr<SharedObject>, IpcErrc> SharedObject::create(const std::string& name, std::size_t bytes,
                                                                    const BeforeAllocate& before,
                                                                    const std::string& dir) {
  if (bytes == 0) return make_error(IpcErrc::kInvalidArgument, "shared memory object " + name + " of 0 bytes");
  if (!dir.empty()) {
    // Whole blocks: on hugetlbfs a block is a huge page, and only whole ones can be mapped.
    struct statvfs v {};
    if (statvfs(dir.c_str(), &v) != 0) return make_error(IpcErrc::kSystem, detail::errno_text(dir.c_str()));
    const std::uint64_t block = v.f_bsize == 0 ? 1 : v.f_bsize;
    std::uint64_t rounded = 0;
    if (bytes > ~std::uint64_t{0} - block || !proto::checked_mul((bytes + block - 1) / block, block, &rounded))
      return make_error(IpcErrc::kInvalidArgument, "shared memory object " + name + " size overflows");
    bytes = static_cast<std::size_t>(rounded);
  }
  const int fd = open_object(name, dir, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  const std::string shown = dir.empty() ? name : path_in(dir, name);
  if (fd < 0) {
    if (errno == EEXIST) return make_error(IpcErrc::kInUse, "shared memory object " + shown + " already exists");
    return make_error(IpcErrc::kSystem, detail::errno_text(("create " + shown).c_str()));
  }
  std::unique_ptr<SharedObject> o(new SharedObject());
  o->name_ = name;
  o->dir_ = dir;
  o->created_ = true;
  o->unlink_ = true;  // until it is complete: a failed create leaves nothing behind
  o->owner_uid_ = getuid();
  o->mode_ = 0600;
  auto fail = [&](IpcErrc code, const std::string& msg) {
    close(fd);
    return make_error(code, msg);
  };
  // Never wider than 0600, whatever the umask; an object whose mode cannot be set is not used.
  if (fchmod(fd, 0600) != 0) return fail(IpcErrc::kSystem, detail::errno_text(("set the mode of " + shown).c_str()));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0)
    return fail(IpcErrc::kSystem, detail::errno_text(("size " + shown).c_str()));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail(IpcErrc::kSystem, detail::errno_text(("map " + shown).c_str()));
  o->data_ = static_cast<std::byte*>(p);
  o->size_ = bytes;
  if (before) before(p, bytes);
  // Every page now, so a full tmpfs is an error here and never a SIGBUS at some later write.
  if (const int e = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0) {
    return fail(e == ENOSPC ? IpcErrc::kNoSpace : IpcErrc::kSystem,
                "cannot allocate shared memory object " + shown + " of " + mib(bytes) + " (" + std::to_string(bytes) +
                    " bytes): " + std::strerror(e) + "; " + room_of(dir));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) return fail(IpcErrc::kSystem, detail::errno_text(("fstat " + shown).c_str()));
  o->inode_ = st.st_ino;
  close(fd);
  o->unlink_ = false;
  return o;
}

Result<std::unique_ptr<SharedObject>, IpcErrc> SharedObject::open(const std::string& name, const std::string& dir) {
  const int fd = open_object(name, dir, O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0) {
    if (errno == ENOENT) return make_error(IpcErrc::kNotFound, "shared memory object " + name + " does not exist");
    if (errno == EACCES) return make_error(IpcErrc::kPermission, "no permission to open " + name);
    return make_error(IpcErrc::kSystem, detail::errno_text(("open " + name).c_str()));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    close(fd);
    return make_error(IpcErrc::kSystem, detail::errno_text("fstat"));
  }
  std::unique_ptr<SharedObject> o(new SharedObject());
  o->name_ = name;
  o->dir_ = dir;
  o->owner_uid_ = st.st_uid;
  o->mode_ = st.st_mode & 0777;
  o->inode_ = st.st_ino;
  if (st.st_size <= 0) {
    close(fd);
    return make_error(IpcErrc::kNotFound, "shared memory object " + name + " is empty");
  }
  void* p = mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return make_error(IpcErrc::kSystem, detail::errno_text(("map " + name).c_str()));
  o->data_ = static_cast<std::byte*>(p);
  o->size_ = static_cast<std::size_t>(st.st_size);
  return o;
}

namespace detail {

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }


std::string check_ring_sizes(std::uint64_t ring_bytes, std::uint32_t completion_capacity) {
  auto pow2 = [](std::uint64_t v) { return v != 0 && (v & (v - 1)) == 0; };
  if (!pow2(ring_bytes) || ring_bytes < kMinRingBytes || ring_bytes > kMaxRingBytes)
    return "task ring bytes " + std::to_string(ring_bytes) + " must be a power of two in [4096, 2^30]";
  if (!pow2(completion_capacity) || completion_capacity > kMaxCompletionCapacity)
    return "completion capacity " + std::to_string(completion_capacity) + " must be a power of two in [1, 2^20]";
  return "";
}

SessionLayout compute_layout(const proto::CacheGeometry& g, std::uint64_t ring_bytes,
                             std::uint32_t completion_capacity) {
  // Inputs passed proto::geometry_problem and check_ring_sizes: ranks <= 16, layers <= 512, ring <= 2^30,
  // capacity <= 2^20, so no term here comes near 2^64.
  auto align_up = [](std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; };
  SessionLayout l{};
  l.registry_offset = align_up(sizeof(proto::SessionHeader), 64);
  l.registry_count = std::uint64_t{g.num_ranks} * g.num_layers * proto::kTensorKinds;
  l.ring_offset = align_up(l.registry_offset + l.registry_count * sizeof(proto::TensorDesc), 4096);
  l.ring_bytes = ring_bytes;
  l.completion_offset = align_up(l.ring_offset + ring_bytes, 4096);
  l.completion_capacity = completion_capacity;
  l.completion_stride = align_up(
      sizeof(proto::CompletionRingControl) + std::uint64_t{completion_capacity} * sizeof(proto::CompletionRecord), 4096);
  l.progress_offset = l.completion_offset + l.completion_stride * g.num_ranks;
  l.progress_stride = align_up(sizeof(proto::ProgressControl) + proto::kProgressSlots * sizeof(proto::LayerProgressSlot) +
                                   std::uint64_t{g.num_layers} * proto::kHandleBytes,
                               4096);
  // The agreement region is implied by the geometry alone; total_bytes (checked) covers it.
  l.agreement_offset = l.progress_offset + l.progress_stride * g.num_ranks;
  l.total_bytes = align_up(l.agreement_offset + sizeof(proto::AgreementControl) +
                               std::uint64_t{g.num_ranks} * proto::kAgreementSlots * sizeof(std::uint64_t),
                           4096);
  return l;
}

proto::SessionHeader* init_session(const SessionView& view, const proto::CacheGeometry& g,
                                   const proto::CacheGroups& groups, std::uint32_t completion_capacity,
                                   std::int64_t now_ns) {
  auto* h = new (view.base) proto::SessionHeader();
  for (std::uint32_t r = 0; r < g.num_ranks; ++r) {
    new (view.completion_control(r)) proto::CompletionRingControl();
    auto* pc = new (view.progress_control(r)) proto::ProgressControl();
    auto* slots = reinterpret_cast<proto::LayerProgressSlot*>(pc + 1);
    for (std::uint32_t i = 0; i < proto::kProgressSlots; ++i) new (&slots[i]) proto::LayerProgressSlot();
  }
  new (view.agreement_control()) proto::AgreementControl();
  for (std::uint32_t r = 0; r < g.num_ranks; ++r)
    for (std::uint32_t i = 0; i < proto::kAgreementSlots; ++i) new (view.agreement_slot(r, i)) std::atomic<std::uint64_t>(0);
  const auto& layout = view.layout;
  h->layout_version = proto::kSessionLayoutVersion;
  h->header_bytes = sizeof(proto::SessionHeader);
  h->generation = (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}() ^
                  static_cast<std::uint64_t>(monotonic_now_ns());
  h->creator_pid = static_cast<std::uint32_t>(getpid());
  h->creator_uid = static_cast<std::uint32_t>(getuid());
  h->completion_capacity = completion_capacity;
  h->geometry = g;
  h->groups = groups;
  h->registry_offset = layout.registry_offset;
  h->registry_count = layout.registry_count;
  h->task_ring_offset = layout.ring_offset;
  h->task_ring_bytes = layout.ring_bytes;
  h->completion_offset = layout.completion_offset;
  h->completion_stride = layout.completion_stride;
  h->progress_offset = layout.progress_offset;
  h->progress_stride = layout.progress_stride;
  h->total_bytes = layout.total_bytes;
  h->engine_pid.store(static_cast<std::uint32_t>(getpid()));
  h->engine_heartbeat_ns.store(now_ns);
  h->state.store(static_cast<std::uint32_t>(proto::SessionState::kCreating));
  // Magic last, with release: a daemon that acquires a non-zero magic sees every field above; one
  // that maps a half-built segment sees 0 and keeps waiting.
  std::atomic_ref<std::uint64_t>(h->magic).store(proto::kSessionMagic, std::memory_order_release);
  return h;
}

HeaderCopy copy_header(const proto::SessionHeader& h) {
  HeaderCopy c;
  c.layout_version = h.layout_version;
  c.header_bytes = h.header_bytes;
  c.completion_capacity = h.completion_capacity;
  c.generation = h.generation;
  c.creator_pid = h.creator_pid;
  c.take_over_host_tier = h.take_over_host_tier;
  c.served_ranks = h.served_ranks;
  std::memcpy(&c.kv_identity, &h.kv_identity, sizeof c.kv_identity);
  c.engine_pid_namespace = h.engine_pid_namespace;
  std::memcpy(&c.geometry, &h.geometry, sizeof c.geometry);
  std::memcpy(&c.groups, &h.groups, sizeof c.groups);
  c.registry_offset = h.registry_offset;
  c.registry_count = h.registry_count;
  c.task_ring_offset = h.task_ring_offset;
  c.task_ring_bytes = h.task_ring_bytes;
  c.completion_offset = h.completion_offset;
  c.completion_stride = h.completion_stride;
  c.total_bytes = h.total_bytes;
  c.progress_offset = h.progress_offset;
  c.progress_stride = h.progress_stride;
  return c;
}

std::string ranks_text(std::uint32_t mask) {
  std::string list;
  int n = 0;
  for (std::uint32_t r = 0; r < 32; ++r)
    if (mask & (1u << r)) {
      list += (list.empty() ? "" : ",") + std::to_string(r);
      ++n;
    }
  return (n == 1 ? "rank " : "ranks ") + list;
}

Result<SessionLayout, IpcErrc> validate_header(const HeaderCopy& h, std::uint64_t mapping_bytes) {
  if (h.layout_version != proto::kSessionLayoutVersion || h.header_bytes != sizeof(proto::SessionHeader))
    return make_error(IpcErrc::kBadVersion, "layout version " + std::to_string(h.layout_version) +
                                                " (header of " + std::to_string(h.header_bytes) +
                                                " bytes); this build speaks " +
                                                std::to_string(proto::kSessionLayoutVersion));
  if (auto why = proto::session_cache_problem(h.geometry, h.groups); !why.empty())
    return make_error(IpcErrc::kCorrupt, "corrupt session header: geometry: " + why);
  if (auto why = check_ring_sizes(h.task_ring_bytes, h.completion_capacity); !why.empty())
    return make_error(IpcErrc::kCorrupt, "corrupt session header: " + why);
  if ((std::uint64_t{h.served_ranks} >> h.geometry.num_ranks) != 0)
    return make_error(IpcErrc::kCorrupt, "corrupt session header: served_ranks " + std::to_string(h.served_ranks) +
                                             " names a rank beyond the geometry's " +
                                             std::to_string(h.geometry.num_ranks));
  if (auto why = proto::kv_identity_problem(h.kv_identity); !why.empty())
    return make_error(IpcErrc::kCorrupt, "corrupt session header: " + why);
  if (h.kv_identity.kv_layout() != proto::KvLayout::kUndeclared && h.groups.num_groups != 0)
    return make_error(IpcErrc::kCorrupt, "corrupt session header: a KV layout declared beside cache groups "
                                         "(each group's kind declares its own)");
  const SessionLayout want = compute_layout(h.geometry, h.task_ring_bytes, h.completion_capacity);
  auto field = [](const char* name, std::uint64_t have, std::uint64_t expect) -> std::string {
    if (have == expect) return "";
    return std::string(name) + " is " + std::to_string(have) + ", the geometry implies " + std::to_string(expect);
  };
  for (const auto& why : {field("registry_offset", h.registry_offset, want.registry_offset),
                          field("registry_count", h.registry_count, want.registry_count),
                          field("task_ring_offset", h.task_ring_offset, want.ring_offset),
                          field("completion_offset", h.completion_offset, want.completion_offset),
                          field("completion_stride", h.completion_stride, want.completion_stride),
                          field("progress_offset", h.progress_offset, want.progress_offset),
                          field("progress_stride", h.progress_stride, want.progress_stride),
                          field("total_bytes", h.total_bytes, want.total_bytes)}) {
    if (!why.empty()) return make_error(IpcErrc::kCorrupt, "corrupt session header: " + why);
  }
  if (want.total_bytes > mapping_bytes)
    return make_error(IpcErrc::kCorrupt, "session is truncated: " + std::to_string(mapping_bytes) +
                                              " bytes mapped, the layout needs " + std::to_string(want.total_bytes));
  return want;
}

std::string session_name(const std::string& suffix) { return "kvtd_" + std::to_string(getuid()) + "_" + suffix; }


std::string geometry_mismatch(const proto::CacheGeometry& have, const proto::CacheGeometry& want) {
  auto shape = [](const std::int64_t* s) {
    return std::to_string(s[0]) + "," + std::to_string(s[1]) + "," + std::to_string(s[2]) + "," + std::to_string(s[3]);
  };
  if (have.num_ranks != want.num_ranks)
    return "num_ranks (mp_num): session has " + std::to_string(have.num_ranks) + ", flags say " + std::to_string(want.num_ranks);
  if (have.num_layers != want.num_layers || have.num_extra_layers != want.num_extra_layers)
    return "num_layers: session has " + std::to_string(have.num_layers - have.num_extra_layers) + " + " +
           std::to_string(have.num_extra_layers) + " extra, flags say " + std::to_string(want.num_layers - want.num_extra_layers) +
           " + " + std::to_string(want.num_extra_layers) + " extra";
  if (have.extra_device_blocks != want.extra_device_blocks)
    return "extra layers' device blocks: session has " + std::to_string(have.extra_device_blocks) + ", flags say " +
           std::to_string(want.extra_device_blocks);
  if (have.dtype != want.dtype)
    return std::string("cache_dtype: session has ") + proto::dtype_name(have.cache_dtype()) + ", flags say " +
           proto::dtype_name(want.cache_dtype());
  if (have.num_host_blocks != want.num_host_blocks)
    return "num_host_blocks: session has " + std::to_string(have.num_host_blocks) + ", flags say " +
           std::to_string(want.num_host_blocks);
  if (have.has_scales() && have.scale_element_bytes() != want.scale_element_bytes())
    return "fp8 scale element bytes (default_dtype): session has " + std::to_string(have.scale_element_bytes()) +
           ", flags say " + std::to_string(want.scale_element_bytes());
  for (int i = 0; i < 4; ++i) {
    if (have.key_shape[i] != want.key_shape[i])
      return "key_cache_shape: session has " + shape(have.key_shape) + ", flags say " + shape(want.key_shape);
  }
  for (int i = 0; i < 4; ++i) {
    if (have.value_shape[i] != want.value_shape[i])
      return "value_cache_shape: session has " + shape(have.value_shape) + ", flags say " + shape(want.value_shape);
  }
  return "";
}

std::string groups_mismatch(const proto::CacheGroups& have, const proto::CacheGroups& want) {
  if (have.num_groups != want.num_groups)
    return "cache groups: session has " + std::to_string(have.num_groups) + ", flags say " +
           std::to_string(want.num_groups) + " (0: a single-shape geometry)";
  if (have.page_tokens != want.page_tokens)
    return "page tokens: session has " + std::to_string(have.page_tokens) + ", flags say " +
           std::to_string(want.page_tokens);
  for (std::uint32_t g = 0; g < have.num_groups && g < proto::kMaxGroups; ++g) {
    const auto& a = have.groups[g];
    const auto& b = want.groups[g];
    const std::string at = "cache group " + std::to_string(g) + " ";
    if (a.kind != b.kind)
      return at + "kind: session has " + proto::group_kind_name(a.group_kind()) + ", flags say " +
             proto::group_kind_name(b.group_kind());
    if (std::memcmp(a.layers, b.layers, sizeof a.layers) != 0) return at + "layers differ";
    if (a.device_blocks != b.device_blocks)
      return at + "device blocks: session has " + std::to_string(a.device_blocks) + ", flags say " +
             std::to_string(b.device_blocks);
    if (a.host_blocks != b.host_blocks)
      return at + "host blocks: session has " + std::to_string(a.host_blocks) + ", flags say " +
             std::to_string(b.host_blocks);
    if (std::memcmp(&a, &b, sizeof a) != 0) return at + "tensors, block tokens or window differ";
  }
  return "";
}

}  // namespace detail
}  // namespace kvtd::ipc
