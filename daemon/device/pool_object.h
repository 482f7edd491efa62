// daemon/device/pool_object.h - the host pool's shared-memory object (private to daemon/device):
// its header, the one record of what the bytes after it hold, and the ways a daemon comes to map
// one: re-mapping its own session's, taking over one it kept from a dead engine's session,
// creating one after checking there is room, and holding it (naming itself in the header, so no
// sweep of dead sessions' objects removes it while this process lives).
//
// Thread-safety: reentrant; one object is made or taken over by one daemon thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "kvtd/daemon/host_pool.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/proto/names.h"

namespace kvtd::daemon::pool_object {

inline constexpr std::uint64_t kMagic = proto::kHostPoolMagic;
inline constexpr std::uint32_t kVersion = 4;  // 2: host layout; 3: PoolShape and group; 4: holder
inline constexpr std::uint64_t kHeaderBytes = 4096;  // the header has the object's first page

// The first page of the pool object. Written once by the creating daemon (magic last), then
// only read, but for `holder` (each daemon that maps it, after checking the rest) and
// `generation` (a take-over); a restarted daemon trusts the object only if every other field
// equals what it would write.
struct Header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t rank;
  std::uint64_t generation;
  std::uint64_t holder;  // proto::HostPoolPrefix::holder
  PoolShape shape;
  std::uint32_t group;
  std::uint32_t reserved0;
  std::uint64_t valid_offset;  // one byte per host block
  std::uint64_t data_offset;   // first region
  std::uint64_t object_bytes;
  std::uint32_t layout;  // HostLayout
  std::uint32_t reserved;
};
static_assert(std::is_standard_layout_v<Header>);
static_assert(sizeof(Header) <= kHeaderBytes);
static_assert(offsetof(Header, magic) == offsetof(proto::HostPoolPrefix, magic) &&
              offsetof(Header, version) == offsetof(proto::HostPoolPrefix, version) &&
              offsetof(Header, rank) == offsetof(proto::HostPoolPrefix, rank) &&
              offsetof(Header, generation) == offsetof(proto::HostPoolPrefix, generation) &&
              offsetof(Header, holder) == offsetof(proto::HostPoolPrefix, holder));

// The header a pool of this shape, session and rank has, naming this process its holder.
Header header_of(const PoolShape& g, std::uint64_t generation, std::uint32_t rank, std::uint32_t group,
                 HostLayout layout, std::uint64_t valid_offset, std::uint64_t data_offset, std::uint64_t object_bytes);

// The pool a previous daemon of this session left under `name` in `dir` ("" = /dev/shm), mapped,
// if it is exactly ours (owner, mode, `mapped` bytes, complete header equal to `want` but for the
// holder); anything else under the name is removed (its blocks are lost) and null returned.
std::unique_ptr<ipc::SharedObject> reopen_if_ours(const std::string& name, const std::string& dir, std::uint64_t mapped,
                                                  const Header& want);

// A pool this daemon kept from a dead session (`from`, of generation `from_generation`) taken
// over under this session's `name`: only when nothing is under `name` yet and `from` is exactly
// `want` but for its generation and holder. False, leaving it to be removed, when anything differs.
bool take_over(const std::string& from, std::uint64_t from_generation, const std::string& name, const std::string& dir,
               std::uint64_t mapped, const Header& want);

// Room for a new pool of `total` bytes (`mapped` in pages of `page`, `blocks` host blocks): free
// huge pages in the kernel's reserve (`dir` set), or free bytes in /dev/shm; refused naming the counts.
Status<DeviceErrc> check_room(const std::string& dir, std::uint64_t page, std::uint64_t mapped, std::uint64_t total,
                              std::uint32_t blocks);

// A new pool object with `want` as its header (magic written last, with release: a restarted
// daemon that acquires it sees a complete header), its pages placed on `numa_node` (-1: anywhere).
Result<std::unique_ptr<ipc::SharedObject>, DeviceErrc> create(const std::string& name, const std::string& dir,
                                                              const Header& want, int numa_node);

// Names this process the holder of the mapped pool starting at `object`.
void hold(std::byte* object);

}  // namespace kvtd::daemon::pool_object
