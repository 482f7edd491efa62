#include "segment.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cerrno>
#include <cstring>

namespace kvtd::ipc::detail {
namespace bip = boost::interprocess;

namespace {
std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

Result<std::unique_ptr<SharedMapping>, IpcErrc> map_object(bip::shared_memory_object& shm, const std::string& name,
                                                           bool owner) {
  auto m = std::make_unique<SharedMapping>();
  struct stat st {};
  if (fstat(shm.get_mapping_handle().handle, &st) != 0) return make_error(IpcErrc::kSystem, errno_text("fstat"));
  m->owner_uid = st.st_uid;
  m->mode = st.st_mode & 0777;
  m->name = name;
  m->owner = owner;
  if (st.st_size == 0) return make_error(IpcErrc::kNotFound, "shared memory object " + name + " is empty");
  auto region = std::make_shared<bip::mapped_region>(shm, bip::read_write);
  m->data = static_cast<std::byte*>(region->get_address());
  m->size = region->get_size();
  m->region = std::move(region);  // the region unmaps when the mapping is destroyed
  return m;
}
}  // namespace

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

SharedMapping::~SharedMapping() {
  region.reset();
  if (owner) remove_mapping(name);
}

Result<std::unique_ptr<SharedMapping>, IpcErrc> create_mapping(const std::string& name, std::size_t bytes) {
  try {
    bip::permissions perm(0600);
    bip::shared_memory_object shm(bip::create_only, name.c_str(), bip::read_write, perm);
    fchmod(shm.get_mapping_handle().handle, 0600);  // never wider than 0600, whatever the umask
    shm.truncate(static_cast<bip::offset_t>(bytes));
    return map_object(shm, name, true);
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::already_exists_error)
      return make_error(IpcErrc::kInUse, "shared memory object " + name + " already exists");
    return make_error(IpcErrc::kSystem, "create " + name + ": " + e.what());
  }
}

Result<std::unique_ptr<SharedMapping>, IpcErrc> open_mapping(const std::string& name) {
  try {
    bip::shared_memory_object shm(bip::open_only, name.c_str(), bip::read_write);
    return map_object(shm, name, false);
  } catch (const bip::interprocess_exception& e) {
    if (e.get_error_code() == bip::not_found_error)
      return make_error(IpcErrc::kNotFound, "shared memory object " + name + " does not exist");
    if (e.get_error_code() == bip::security_error)
      return make_error(IpcErrc::kPermission, "no permission to open " + name);
    return make_error(IpcErrc::kSystem, "open " + name + ": " + e.what());
  }
}

void remove_mapping(const std::string& name) { bip::shared_memory_object::remove(name.c_str()); }

SessionLayout compute_layout(const proto::CacheGeometry& g, std::uint64_t ring_bytes,
                             std::uint32_t completion_capacity) {
  SessionLayout l{};
  l.registry_offset = align_up(sizeof(proto::SessionHeader), 64);
  l.registry_count = std::uint64_t{g.num_ranks} * g.num_layers * proto::kTensorKinds;
  l.ring_offset = align_up(l.registry_offset + l.registry_count * sizeof(proto::TensorDesc), 4096);
  l.ring_bytes = ring_bytes;
  l.completion_offset = align_up(l.ring_offset + ring_bytes, 4096);
  l.completion_capacity = completion_capacity;
  l.completion_stride =
      align_up(sizeof(proto::CompletionRingControl) + std::uint64_t{completion_capacity} * sizeof(proto::CompletionRecord), 4096);
  l.progress_offset = l.completion_offset + l.completion_stride * g.num_ranks;
  l.progress_stride = align_up(sizeof(proto::ProgressControl) + proto::kProgressSlots * sizeof(proto::LayerProgressSlot) +
                                   std::uint64_t{g.num_layers} * proto::kHandleBytes,
                               4096);
  l.total_bytes = l.progress_offset + l.progress_stride * g.num_ranks;
  return l;
}

std::string session_name(const std::string& suffix) { return "kvtd_" + std::to_string(getuid()) + "_" + suffix; }

std::string geometry_mismatch(const proto::CacheGeometry& have, const proto::CacheGeometry& want) {
  auto shape = [](const std::int64_t* s) {
    return std::to_string(s[0]) + "," + std::to_string(s[1]) + "," + std::to_string(s[2]) + "," + std::to_string(s[3]);
  };
  if (have.num_ranks != want.num_ranks)
    return "num_ranks (mp_num): session has " + std::to_string(have.num_ranks) + ", flags say " + std::to_string(want.num_ranks);
  if (have.num_layers != want.num_layers)
    return "num_layers: session has " + std::to_string(have.num_layers) + ", flags say " + std::to_string(want.num_layers);
  if (have.dtype != want.dtype)
    return std::string("cache_dtype: session has ") + proto::dtype_name(have.cache_dtype()) + ", flags say " +
           proto::dtype_name(want.cache_dtype());
  if (have.num_host_blocks != want.num_host_blocks)
    return "num_host_blocks: session has " + std::to_string(have.num_host_blocks) + ", flags say " +
           std::to_string(want.num_host_blocks);
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

}  // namespace kvtd::ipc::detail
