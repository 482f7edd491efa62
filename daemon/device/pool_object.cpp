#include "pool_object.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <optional>

#include "kvtd/daemon/log.h"
#include "kvtd/daemon/numa.h"
#include "kvtd/ipc/process.h"

namespace kvtd::daemon::pool_object {
namespace {

std::string mib(std::uint64_t b) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

std::atomic_ref<std::uint64_t> magic_of(std::byte* object) {
  return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(object));
}

// The header of a pool object this uid made private and complete (magic written), `mapped` bytes
// long, with `holder` read as `want`'s (it names whichever daemon mapped it last, not its
// content); nullopt for anything else.
std::optional<Header> complete_header(ipc::SharedObject& o, std::uint64_t mapped, const Header& want) {
  if (o.owner_uid() != getuid() || (o.mode() & 077) != 0 || o.size() != mapped) return std::nullopt;
  if (magic_of(o.data()).load(std::memory_order_acquire) != kMagic) return std::nullopt;
  Header have;
  std::memcpy(&have, o.data(), sizeof have);
  have.holder = want.holder;
  return have;
}

}  // namespace

Header header_of(const PoolShape& g, std::uint64_t generation, std::uint32_t rank, std::uint32_t group,
                 HostLayout layout, std::uint64_t valid_offset, std::uint64_t data_offset, std::uint64_t object_bytes) {
  Header h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.rank = rank;
  h.generation = generation;
  h.holder = ipc::self_owner_word();
  h.shape = g;
  h.group = group;
  h.valid_offset = valid_offset;
  h.data_offset = data_offset;
  h.object_bytes = object_bytes;
  h.layout = static_cast<std::uint32_t>(layout);
  return h;
}



void hold(std::byte* object) {
  std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(object + offsetof(Header, holder)))
      .store(ipc::self_owner_word(), std::memory_order_release);
}

std::unique_ptr<ipc::SharedObject> reopen_if_ours(const std::string& name, const std::string& dir, std::uint64_t mapped,
                                                  const Header& want) {
  auto old = ipc::SharedObject::open(name, dir);
  if (!old.ok()) return nullptr;
  auto& o = *old;
  const auto have = complete_header(*o, mapped, want);
  if (have && std::memcmp(&*have, &want, sizeof want) == 0) return std::move(o);
  KVTD_WARN("host pool object {} does not match this session and geometry; recreating it (its blocks are lost)", name);
  o.reset();
  ipc::SharedObject::remove(name, dir);
  return nullptr;
}

// Renamed first (then no sweep takes it for a dead session's while its header changes), then its
// header gets the new generation, magic cleared meanwhile (a daemon restarted in between sees an
// incomplete pool and makes a new one rather than trust a half-written header).
bool take_over(const std::string& from, std::uint64_t from_generation, const std::string& name, const std::string& dir,
               std::uint64_t mapped, const Header& want) {
  const std::string at = dir.empty() ? std::string("/dev/shm") : dir;
  struct stat st {};
  if (lstat((at + "/" + name).c_str(), &st) == 0) return false;  // ours already: re-mapped as usual
  auto old = ipc::SharedObject::open(from, dir);
  if (!old.ok()) return false;
  auto& o = *old;
  auto have = complete_header(*o, mapped, want);
  if (!have || have->generation != from_generation) return false;
  have->generation = want.generation;
  if (std::memcmp(&*have, &want, sizeof want) != 0) {
    KVTD_WARN("host pool {} of the session this one follows differs in shape or layout; not taken over", from);
    return false;
  }
  if (::rename((at + "/" + from).c_str(), (at + "/" + name).c_str()) != 0) {
    KVTD_WARN("host pool {} not taken over: rename to {} failed: {}", from, name, std::strerror(errno));
    return false;
  }
  magic_of(o->data()).store(0, std::memory_order_relaxed);
  std::memcpy(o->data() + offsetof(Header, generation), &want.generation, sizeof want.generation);
  magic_of(o->data()).store(kMagic, std::memory_order_release);
  return true;
}

Status<DeviceErrc> check_room(const std::string& dir, std::uint64_t page, std::uint64_t mapped, std::uint64_t total,
                              std::uint32_t blocks) {
  if (!dir.empty()) {
    const std::int64_t free_pages = ipc::free_huge_pages(page);
    if (free_pages >= 0 && static_cast<std::uint64_t>(free_pages) < mapped / page)
      return make_error(DeviceErrc::kAllocFailed,
                        fmt::format("--host-pool-hugepages: the host pool needs {} pages of {} kB ({}, {} blocks) and "
                                    "the kernel has {} free (HugePages_Free less HugePages_Rsvd in /proc/meminfo); "
                                    "reserve more (sysctl -w vm.nr_hugepages=...) or lower --num-host-blocks",
                                    mapped / page, page >> 10, mib(total), blocks, free_pages));
    return {};
  }
  if (const std::int64_t free_now = ipc::shm_free_bytes(); free_now >= 0 && static_cast<std::uint64_t>(free_now) < total)
    return make_error(DeviceErrc::kAllocFailed,
                      fmt::format("host pool needs {} ({} blocks) in /dev/shm, which has {} free; enlarge it "
                                  "(mount -o remount,size=... /dev/shm) or lower --num-host-blocks",
                                  mib(total), blocks, mib(static_cast<std::uint64_t>(free_now))));
  return {};
}

Result<std::unique_ptr<ipc::SharedObject>, DeviceErrc> create(const std::string& name, const std::string& dir,
                                                                          const Header& want, int numa_node) {
  auto created = ipc::SharedObject::create(
      name, want.object_bytes,
      [numa_node](void* addr, std::size_t bytes) {
        std::string why;
        if (numa_node >= 0 && !bind_to_numa_node(addr, bytes, numa_node, &why))
          KVTD_WARN("host pool not placed on NUMA node {}: {}", numa_node, why);
      },
      dir);
  if (!created.ok()) return make_error(DeviceErrc::kAllocFailed, "host pool: " + created.error().message);
  auto o = std::move(created).value();
  std::memcpy(o->data(), &want, sizeof want);
  magic_of(o->data()).store(0, std::memory_order_relaxed);
  magic_of(o->data()).store(kMagic, std::memory_order_release);
  return o;
}

}  // namespace kvtd::daemon::pool_object
