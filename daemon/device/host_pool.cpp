#include "kvtd/daemon/host_pool.h"

#include "kvtd/proto/group_slots.h"
#include "kvtd/proto/names.h"

#include "pool_object.h"
#include "pool_pinner.h"

#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <atomic>
#include <utility>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "kvtd/daemon/log.h"
#include "kvtd/ipc/liveness_lock.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/proto/checked.h"

namespace kvtd::daemon {
namespace {

constexpr std::uint64_t kPage = pool_object::kHeaderBytes;  // the header page; regions are page-aligned

struct PoolLayout {
  std::uint64_t valid_offset = kPage, data_offset = 0, total = 0;
  std::vector<std::uint64_t> region_offset;  // by layer * kinds + kind; ~0 = none
  std::uint64_t page_stride = 0;             // page-first: bytes of one block, every layer
};

bool layout_of(const PoolShape& g, HostLayout layout, PoolLayout* out) {
  PoolLayout l;
  std::uint64_t v = 0;
  if (!proto::checked_align_up(g.num_host_blocks, kPage, &v)) return false;
  l.data_offset = kPage + v;
  std::uint64_t at = l.data_offset;
  l.region_offset.assign(std::size_t{g.num_layers} * proto::kTensorKinds, ~0ull);
  if (layout == HostLayout::kPageFirst && g.num_host_blocks != 0) {  // no blocks: no regions
    // Block b of (layer, kind) at data + b * stride + the (layer, kind) offset inside a block:
    // the order of a stored object (layer-major, then key, value, key scale, value scale).
    l.page_stride = g.block_bytes_all_layers();
    if (l.page_stride == 0) return false;
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

std::uint64_t lcm_with_page(std::uint64_t unit) {
  std::uint64_t out = 0;
  return unit != 0 && proto::checked_mul(unit / std::gcd(unit, kPage), kPage, &out) ? out : 0;
}

// A region of the pool in memory order: where it starts, its bytes up to the next region (or the
// object's end), and the bytes one block takes in it.
struct PinRegion {
  std::uint64_t offset, bytes, block_bytes;
};

std::vector<PinRegion> pin_regions(const PoolShape& g, const PoolLayout& l) {
  std::vector<PinRegion> out;
  if (l.page_stride != 0) {
    out.push_back({l.data_offset, l.total - l.data_offset, l.page_stride});
    return out;
  }
  for (std::size_t i = 0; i < l.region_offset.size(); ++i) {
    if (l.region_offset[i] == ~0ull) continue;
    std::uint64_t end = 0;  // the next region, or the object's end: regions are consecutive
    for (std::size_t j = i + 1; j < l.region_offset.size() && end == 0; ++j)
      if (l.region_offset[j] != ~0ull) end = l.region_offset[j];
    if (end == 0) end = l.total;
    out.push_back({l.region_offset[i], end - l.region_offset[i],
                   g.block_bytes(static_cast<proto::TensorKind>(i % proto::kTensorKinds))});
  }
  return out;
}

// A pool pinned whole before serving: whole regions merged while they fit in `chunk`, a region
// larger than that split at multiples of lcm(block bytes, page). So no block, and no page, is in
// two registrations (cudaHostRegister refuses overlapping ranges, and a copy of one block must
// stay inside one), and no call exceeds the chunk (drivers refuse one of >= 512 GiB). The pool's
// header and validity bytes are read by the CPU only and stay unpinned.
std::vector<std::pair<std::uint64_t, std::uint64_t>> whole_pool_pieces(const std::vector<PinRegion>& regions,
                                                                       std::uint64_t chunk) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const PinRegion& r : regions) {
    if (r.bytes == 0) continue;
    if (r.bytes <= chunk) {
      if (!out.empty() && out.back().first + out.back().second == r.offset && out.back().second + r.bytes <= chunk)
        out.back().second += r.bytes;
      else
        out.emplace_back(r.offset, r.bytes);
      continue;
    }
    const std::uint64_t unit = lcm_with_page(r.block_bytes);
    const std::uint64_t step = (unit == 0 || unit >= chunk) ? r.bytes : chunk / unit * unit;
    for (std::uint64_t at = 0; at < r.bytes; at += step) out.emplace_back(r.offset + at, std::min(step, r.bytes - at));
  }
  return out;
}

// The pieces the pool is pinned in, ordered by the first block each holds. A pool of at most
// plan.first_bytes: the whole-pool pieces, all "from block 0" (pinned before serving). A larger
// one in slices of block ranges, each slice one piece per region: the first about first_bytes in
// all, each next twice the last, up to chunk bytes per piece. Slice bounds are multiples of a
// block count that keeps every piece's start on a page in every region.
std::vector<detail::PinPiece> pin_pieces(const PoolShape& g, const PoolLayout& l, std::byte* base,
                                 const HostPool::PinPlan& plan) {
  const std::vector<PinRegion> regions = pin_regions(g, l);
  std::uint64_t per_block = 0, largest = 0, align_blocks = 1;
  for (const PinRegion& r : regions) {
    per_block += r.block_bytes;
    largest = std::max(largest, r.block_bytes);
    const std::uint64_t unit = lcm_with_page(r.block_bytes);  // bytes; a multiple of the block
    const std::uint64_t blocks = unit == 0 ? 0 : unit / r.block_bytes;
    align_blocks = blocks == 0 ? 0 : std::lcm(align_blocks, blocks);
    if (align_blocks == 0 || align_blocks > g.num_host_blocks) align_blocks = 0;
    if (align_blocks == 0) break;
  }
  std::vector<detail::PinPiece> out;
  const std::uint64_t n = g.num_host_blocks;
  std::uint64_t pool_bytes = 0;
  const bool whole = align_blocks == 0 || per_block == 0 || !proto::checked_mul(per_block, n, &pool_bytes) ||
                     pool_bytes <= plan.first_bytes;
  if (whole) {
    for (const auto& [offset, bytes] : whole_pool_pieces(regions, plan.chunk_bytes)) out.push_back({base + offset, bytes, 0});
    return out;
  }
  const auto round = [&](std::uint64_t blocks) { return std::max(align_blocks, blocks / align_blocks * align_blocks); };
  const std::uint64_t most = round(plan.chunk_bytes / largest);  // a piece's blocks within the chunk
  std::uint64_t slice = std::min(most, round(plan.first_bytes / per_block));
  for (std::uint64_t b0 = 0; b0 < n; b0 += slice, slice = std::min(most, slice * 2)) {
    const std::uint64_t b1 = std::min(n, b0 + slice);
    for (const PinRegion& r : regions) {
      const std::uint64_t from = b0 * r.block_bytes, to = b1 == n ? r.bytes : b1 * r.block_bytes;
      out.push_back({base + r.offset + from, to - from, static_cast<std::uint32_t>(b0)});
    }
  }
  return out;
}

}  // namespace

std::uint64_t PoolShape::block_bytes_all_layers() const {
  std::uint64_t per_layer = 0, out = 0;
  for (const std::uint64_t b : tensor_block_bytes)
    if (!proto::checked_add(per_layer, b, &per_layer)) return 0;
  if (!proto::checked_mul(per_layer, num_layers, &out) || out >= proto::kMaxSizeBytes) return 0;
  return out;
}

PoolShape PoolShape::of(const proto::CacheGeometry& g) {
  PoolShape s;
  s.num_layers = g.num_layers;
  s.num_host_blocks = g.num_host_blocks;
  for (std::uint32_t k = 0; k < proto::kTensorKinds; ++k) s.tensor_block_bytes[k] = g.block_bytes(static_cast<proto::TensorKind>(k));
  return s;
}

PoolShape PoolShape::of(const proto::CacheGroups& gs, std::uint32_t group) {
  PoolShape s;
  if (group >= gs.num_groups || group >= proto::kMaxGroups) return s;
  const proto::CacheGroup& c = gs.groups[group];
  s.num_layers = c.num_layers();
  s.num_host_blocks = c.host_blocks;
  for (std::uint32_t t = 0; t < c.num_tensors && t < proto::kTensorKinds; ++t)
    s.tensor_block_bytes[t] = proto::group_tensor_block_bytes(c.tensors[t]);
  return s;
}

std::vector<PoolShape> PoolShape::of_session(const proto::CacheGeometry& g, const proto::CacheGroups& gs) {
  if (gs.num_groups == 0) return {of(g)};
  std::vector<PoolShape> out;
  for (std::uint32_t i = 0; i < gs.num_groups && i < proto::kMaxGroups; ++i) out.push_back(of(gs, i));
  return out;
}

std::uint64_t HostPool::object_bytes(const PoolShape& g, HostLayout layout) {
  PoolLayout l;
  return layout_of(g, layout, &l) ? l.total : 0;
}

Result<std::uint64_t, DeviceErrc> HostPool::hugetlbfs_page_bytes(const std::string& dir) {
  constexpr long kHugetlbfsMagic = 0x958458f6;  // linux/magic.h HUGETLBFS_MAGIC
  struct statfs f {};
  if (::statfs(dir.c_str(), &f) != 0)
    return make_error(DeviceErrc::kAllocFailed, "--host-pool-hugepages: " + dir + ": " + std::strerror(errno) +
                                                    " (mount one: mount -t hugetlbfs none " + dir + ")");
  if (static_cast<long>(f.f_type) != kHugetlbfsMagic)
    return make_error(DeviceErrc::kAllocFailed, "--host-pool-hugepages: " + dir +
                                                    " is not a hugetlbfs mount (mount -t hugetlbfs none " + dir +
                                                    ", or name one with --hugetlbfs-dir)");
  return static_cast<std::uint64_t>(f.f_bsize);
}

Result<std::unique_ptr<HostPool>, DeviceErrc> HostPool::open(HostMemory& backend, const PoolShape& g,
                                                             std::uint64_t generation, std::uint32_t rank,
                                                             std::uint32_t group, HostLayout layout, int numa_node,
                                                             const PinPlan& pin, const std::string& hugetlbfs_dir,
                                                             std::uint64_t take_over_generation) {
  PoolLayout l;
  if (!layout_of(g, layout, &l) || l.total >= proto::kMaxSizeBytes)
    return make_error(DeviceErrc::kAllocFailed, "host pool size overflows");
  std::uint64_t page = 4096, mapped = l.total;  // hugetlbfs maps whole huge pages only
  if (!hugetlbfs_dir.empty()) {
    KVTD_ASSIGN_OR_RETURN(page, hugetlbfs_page_bytes(hugetlbfs_dir));
    mapped = (l.total + page - 1) / page * page;
  }
  const std::string name = ipc::session_object_name(generation, proto::host_pool_object(rank, group));
  const pool_object::Header want =
      pool_object::header_of(g, generation, rank, group, layout, l.valid_offset, l.data_offset, l.total);

  std::unique_ptr<HostPool> pool(new HostPool());
  pool->backend_ = &backend;
  pool->blocks_ = g.num_host_blocks;
  pool->sums_kept_ = std::make_unique<std::atomic<std::uint16_t>[]>(g.num_host_blocks);
  pool->page_bytes_ = page;
  if (take_over_generation != 0 && take_over_generation != generation &&
      pool_object::take_over(ipc::session_object_name(take_over_generation, proto::host_pool_object(rank, group)),
                             take_over_generation, name, hugetlbfs_dir, mapped, want))
    pool->adopted_ = take_over_generation;
  pool->object_ = pool_object::reopen_if_ours(name, hugetlbfs_dir, mapped, want);
  pool->restored_ = pool->object_ != nullptr;
  if (!pool->object_) {
    KVTD_TRY(pool_object::check_room(hugetlbfs_dir, page, mapped, l.total, g.num_host_blocks));
    KVTD_ASSIGN_OR_RETURN(pool->object_, pool_object::create(name, hugetlbfs_dir, want, numa_node));
  }

  std::byte* base = pool->object_->data();
  pool_object::hold(base);
  auto lock = ipc::LivenessLock::take(name, pool->object_->inode(), ipc::kPoolHolderLockByte, hugetlbfs_dir);
  if (lock.ok())
    pool->holder_lock_ = std::make_unique<ipc::LivenessLock>(std::move(lock).value());
  else  // judged by this process's pid alone, as before the lock: a sweep in another pid namespace may take it
    KVTD_WARN("host pool {}: no holder lock ({}); a sweep in another pid namespace may remove it", name,
              lock.error().message);
  std::vector<detail::PinPiece> pieces;
  if (backend.pins_memory()) pieces = pin_pieces(g, l, base, pin);
  pool->pinner_ = std::make_unique<detail::PoolPinner>(backend, std::move(pieces), g.num_host_blocks, pin.on_progress);
  KVTD_TRY(pool->pinner_->pin_first(pin.threads));
  pool->pinner_->start_background(pin.threads);
  pool->valid_ = reinterpret_cast<std::uint8_t*>(base + l.valid_offset);
  pool->regions_.assign(l.region_offset.size(), nullptr);
  for (std::size_t i = 0; i < l.region_offset.size(); ++i)
    if (l.region_offset[i] != ~0ull) pool->regions_[i] = base + l.region_offset[i];
  pool->total_ = l.total;
  pool->shape_ = g;
  pool->page_stride_ = l.page_stride;
  return pool;
}

std::uint32_t HostPool::pinned_blocks() const { return pinner_->pinned_blocks(); }

Status<DeviceErrc> HostPool::wait_pinned(std::uint32_t end,
                                         const std::function<std::optional<std::string>()>& give_up) {
  return pinner_->wait_pinned(end, give_up);
}

HostPool::PinProgress HostPool::pin_progress() const { return pinner_->progress(); }

HostPool::~HostPool() = default;

std::unique_ptr<ipc::LivenessLock> HostPool::release_holder_lock() { return std::move(holder_lock_); }

std::vector<std::unique_ptr<ipc::LivenessLock>> HostPools::release_holder_locks() {
  std::vector<std::unique_ptr<ipc::LivenessLock>> locks;
  for (auto& p : pools_)
    if (auto l = p->release_holder_lock()) locks.push_back(std::move(l));
  return locks;
}

const std::string& HostPool::name() const { return object_->name(); }

std::uint64_t HostPool::stride(proto::TensorKind kind) const {
  return page_stride_ != 0 ? page_stride_ : shape_.block_bytes(kind);
}

void HostPool::remove() { ipc::SharedObject::remove(object_->name(), object_->dir()); }

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
  for (auto id : ids) {
    (void)std::atomic_ref<std::uint8_t>(valid_[id]).exchange(0, std::memory_order_seq_cst);
    sums_kept_[id].store(0, std::memory_order_relaxed);
  }
}

void HostPool::mark_all_invalid() {
  for (std::uint32_t id = 0; id < blocks_; ++id) {
    (void)std::atomic_ref<std::uint8_t>(valid_[id]).exchange(0, std::memory_order_seq_cst);
    sums_kept_[id].store(0, std::memory_order_relaxed);
  }
}

void HostPool::set_checksums(std::int32_t id, std::span<const std::uint64_t> sums) {
  if (sums.empty() || sums.size() > 65535) return;
  std::call_once(sums_once_, [&] {
    sums_per_block_ = sums.size();
    sums_.assign(std::size_t{blocks_} * sums_per_block_, 0);
  });
  if (sums.size() != sums_per_block_) return;
  std::copy(sums.begin(), sums.end(), sums_.begin() + static_cast<std::ptrdiff_t>(std::size_t(id) * sums_per_block_));
  sums_kept_[id].store(static_cast<std::uint16_t>(sums.size()), std::memory_order_release);
}

std::span<const std::uint64_t> HostPool::checksums(std::int32_t id) const {
  const std::uint16_t n = sums_kept_[id].load(std::memory_order_acquire);
  if (n == 0) return {};
  return std::span<const std::uint64_t>(sums_).subspan(std::size_t(id) * sums_per_block_, n);
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
