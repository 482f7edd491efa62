#include "kvtd/daemon/host_pool.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/proto/checked.h"

namespace kvtd::daemon {
namespace {

constexpr std::uint64_t kPoolMagic = 0x4c4f4f5044545640ULL;  // "@VTDPOOL"
constexpr std::uint32_t kPoolVersion = 2;  // 2: host layout
constexpr std::uint64_t kPage = 4096;

// The first page of the pool object. Written once by the creating daemon (magic last), then
// only read; a restarted daemon trusts the object only if every field equals what it would write.
struct PoolHeader {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t rank;
  std::uint64_t generation;
  proto::CacheGeometry geometry;
  std::uint64_t valid_offset;  // one byte per host block
  std::uint64_t data_offset;   // first region
  std::uint64_t object_bytes;
  std::uint32_t layout;  // config::HostLayout
  std::uint32_t reserved;
};
static_assert(std::is_standard_layout_v<PoolHeader>);
static_assert(sizeof(PoolHeader) <= kPage);

struct PoolLayout {
  std::uint64_t valid_offset = kPage, data_offset = 0, total = 0;
  std::vector<std::uint64_t> region_offset;  // by layer * kinds + kind; ~0 = none
  std::uint64_t page_stride = 0;             // page-first: bytes of one block, every layer
};

bool layout_of(const proto::CacheGeometry& g, config::HostLayout layout, PoolLayout* out) {
  PoolLayout l;
  std::uint64_t v = 0;
  if (!proto::checked_align_up(g.num_host_blocks, kPage, &v)) return false;
  l.data_offset = kPage + v;
  std::uint64_t at = l.data_offset;
  l.region_offset.assign(std::size_t{g.num_layers} * proto::kTensorKinds, ~0ull);
  if (layout == config::HostLayout::kPageFirst && g.num_host_blocks != 0) {  // no blocks: no regions
    // Block b of (layer, kind) at data + b * stride + the (layer, kind) offset inside a block:
    // the order of a stored object (layer-major, then key, value, key scale, value scale).
    const auto sizes = proto::geometry_sizes(g);
    if (sizes.problem != nullptr) return false;
    l.page_stride = sizes.block_bytes_all_layers;
    std::uint64_t in_block = 0;
    for (std::uint32_t layer = 0; layer < g.num_layers; ++layer)
      for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
        const std::uint64_t bb = g.block_bytes(static_cast<proto::TensorKind>(k));
        if (bb == 0) continue;
        l.region_offset[layer * proto::kTensorKinds + k] = at + in_block;
        in_block += bb;
      }
    std::uint64_t bytes = 0, aligned = 0;
    if (!proto::checked_mul(l.page_stride, g.num_host_blocks, &bytes) || !proto::checked_align_up(bytes, kPage, &aligned) ||
        !proto::checked_add(at, aligned, &l.total))
      return false;
    *out = std::move(l);
    return true;
  }
  for (std::uint32_t layer = 0; layer < g.num_layers; ++layer)
    for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) {
      std::uint64_t bytes = 0, aligned = 0;
      if (!proto::checked_mul(g.block_bytes(static_cast<proto::TensorKind>(k)), g.num_host_blocks, &bytes)) return false;
      if (bytes == 0) continue;
      l.region_offset[layer * proto::kTensorKinds + k] = at;
      // Page-aligned regions: DMA and memcpy friendly.
      if (!proto::checked_align_up(bytes, kPage, &aligned) || !proto::checked_add(at, aligned, &at)) return false;
    }
  l.total = at;
  *out = std::move(l);
  return true;
}

std::string mib(std::uint64_t b) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

}  // namespace

std::uint64_t HostPool::object_bytes(const proto::CacheGeometry& g, config::HostLayout layout) {
  PoolLayout l;
  return layout_of(g, layout, &l) ? l.total : 0;
}

Result<std::unique_ptr<HostPool>, DeviceErrc> HostPool::open(HostMemory& backend, const proto::CacheGeometry& g,
                                                             std::uint64_t generation, std::uint32_t rank,
                                                             config::HostLayout layout, int numa_node) {
  PoolLayout l;
  if (!layout_of(g, layout, &l) || l.total >= proto::kMaxSizeBytes)
    return make_error(DeviceErrc::kAllocFailed, "host pool size overflows");
  const std::string name = ipc::session_object_name(generation, "host" + std::to_string(rank));
  PoolHeader want{};
  want.magic = kPoolMagic;
  want.version = kPoolVersion;
  want.rank = rank;
  want.generation = generation;
  want.geometry = g;
  want.valid_offset = l.valid_offset;
  want.data_offset = l.data_offset;
  want.object_bytes = l.total;
  want.layout = static_cast<std::uint32_t>(layout);

  std::unique_ptr<HostPool> pool(new HostPool());
  pool->backend_ = &backend;
  pool->blocks_ = g.num_host_blocks;

  // A pool a previous daemon of this session left behind: used only if it is exactly ours.
  if (auto old = ipc::SharedObject::open(name); old.ok()) {
    auto& o = *old;
    bool same = o->owner_uid() == getuid() && (o->mode() & 077) == 0 && o->size() == l.total;
    if (same) {
      PoolHeader have;
      std::memcpy(&have, o->data(), sizeof have);
      same = std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(o->data())).load(std::memory_order_acquire) ==
                 kPoolMagic &&
             std::memcmp(&have, &want, sizeof have) == 0;
    }
    if (same) {
      pool->object_ = std::move(o);
      pool->restored_ = true;
    } else {
      KVTD_WARN("host pool object {} does not match this session and geometry; recreating it (its blocks are lost)",
                name);
      old->reset();
      ipc::SharedObject::remove(name);
    }
  }
  if (!pool->object_) {
    const std::int64_t free_now = ipc::shm_free_bytes();
    if (free_now >= 0 && static_cast<std::uint64_t>(free_now) < l.total)
      return make_error(DeviceErrc::kAllocFailed,
                        "host pool needs " + mib(l.total) + " (" + std::to_string(g.num_host_blocks) +
                            " blocks) in /dev/shm, which has " + mib(static_cast<std::uint64_t>(free_now)) +
                            " free; enlarge it (mount -o remount,size=... /dev/shm) or lower --num-host-blocks");
    const int node = numa_node;
    auto created = ipc::SharedObject::create(name, l.total, [node](void* addr, std::size_t bytes) {
      std::string why;
      if (node >= 0 && !bind_to_numa_node(addr, bytes, node, &why))
        KVTD_WARN("host pool not placed on NUMA node {}: {}", node, why);
    });
    if (!created.ok()) return make_error(DeviceErrc::kAllocFailed, "host pool: " + created.error().message);
    pool->object_ = std::move(created).value();
    std::memcpy(pool->object_->data(), &want, sizeof want);
    // Magic last, with release: a restarted daemon that acquires it sees a complete header.
    std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(pool->object_->data()))
        .store(0, std::memory_order_relaxed);
    std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(pool->object_->data()))
        .store(kPoolMagic, std::memory_order_release);
  }

  std::byte* base = pool->object_->data();
  KVTD_TRY(backend.pin_host(base, pool->object_->size()));
  pool->pinned_ = base;
  pool->valid_ = reinterpret_cast<std::uint8_t*>(base + l.valid_offset);
  pool->regions_.assign(l.region_offset.size(), nullptr);
  for (std::size_t i = 0; i < l.region_offset.size(); ++i)
    if (l.region_offset[i] != ~0ull) pool->regions_[i] = base + l.region_offset[i];
  pool->total_ = l.total;
  pool->geometry_ = g;
  pool->page_stride_ = l.page_stride;
  return pool;
}

HostPool::~HostPool() {
  if (pinned_ != nullptr) backend_->unpin_host(pinned_);
}

const std::string& HostPool::name() const { return object_->name(); }

std::uint64_t HostPool::stride(proto::TensorKind kind) const {
  return page_stride_ != 0 ? page_stride_ : geometry_.block_bytes(kind);
}

void HostPool::remove() { ipc::SharedObject::remove(object_->name()); }

std::size_t HostPool::valid_blocks() const {
  std::size_t n = 0;
  for (std::uint32_t b = 0; b < blocks_; ++b)
    n += std::atomic_ref<std::uint8_t>(valid_[b]).load(std::memory_order_acquire) == 1;
  return n;
}

void HostPool::mark_invalid(std::span<const std::int32_t> ids) {
  // Sequentially consistent read-modify-writes (a locked instruction, a full barrier on x86; no
  // fence, which TSan cannot model): the clears are in memory before the copy that follows
  // writes a byte of these blocks, so a crash mid-copy leaves them invalid.
  for (auto id : ids) (void)std::atomic_ref<std::uint8_t>(valid_[id]).exchange(0, std::memory_order_seq_cst);
}

void HostPool::mark_all_invalid() {
  for (std::uint32_t id = 0; id < blocks_; ++id)
    (void)std::atomic_ref<std::uint8_t>(valid_[id]).exchange(0, std::memory_order_seq_cst);
}

void HostPool::mark_valid(std::span<const std::int32_t> ids) {
  for (auto id : ids) std::atomic_ref<std::uint8_t>(valid_[id]).store(1, std::memory_order_release);
}

std::optional<std::int32_t> HostPool::first_invalid(std::span<const std::int32_t> ids) const {
  for (auto id : ids)
    if (std::atomic_ref<std::uint8_t>(valid_[id]).load(std::memory_order_acquire) != 1) return id;
  return std::nullopt;
}

}  // namespace kvtd::daemon
