// kvtd/ipc/shared_object.h - a named POSIX shared-memory object, mapped read-write.
//
// create() allocates every byte at creation (posix_fallocate): a full /dev/shm fails there with
// a message naming the size and the free space, never with SIGBUS at a later write. Objects are
// mode 0600 whatever the umask.
//
// An object lives in /dev/shm (shm_open), or, given a directory, as a file there: a hugetlbfs
// mount gives the object 2 MiB (or 1 GiB) pages, and like /dev/shm it outlives the process. Its
// size is then rounded up to the file system's block size (the huge page: hugetlbfs maps whole
// pages only).
//
// Ownership: a SharedObject owns its mapping (unmapped on destruction); it unlinks the name on
// destruction only if unlink_on_destroy is set. Not copyable or movable (held by unique_ptr).
// Thread-safety: the bytes are the user's to synchronise; the object itself is immutable.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvtd/ipc/errors.h"
#include "kvtd/proto/expected.h"

namespace kvtd::ipc {

class SharedObject {
 public:
  // Called on the fresh mapping before its pages are allocated, e.g. to bind it to a NUMA node.
  using BeforeAllocate = std::function<void(void* addr, std::size_t bytes)>;

  // Creates `name` (kInUse if it exists), sizes it to `bytes` and allocates every page. `dir`:
  // empty for /dev/shm, else the directory the object is a file in (no '/' in `name`).
  static Result<std::unique_ptr<SharedObject>, IpcErrc> create(const std::string& name, std::size_t bytes,
                                                               const BeforeAllocate& before = {},
                                                               const std::string& dir = {});
  // Maps an existing object; owner_uid()/mode() let the caller refuse foreign ones.
  static Result<std::unique_ptr<SharedObject>, IpcErrc> open(const std::string& name, const std::string& dir = {});
  // Unlinks a name; a missing one is not an error.
  static void remove(const std::string& name, const std::string& dir = {});

  ~SharedObject();
  SharedObject(const SharedObject&) = delete;
  SharedObject& operator=(const SharedObject&) = delete;

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  const std::string& dir() const { return dir_; }  // empty: /dev/shm
  uid_t owner_uid() const { return owner_uid_; }
  mode_t mode() const { return mode_; }
  ino_t inode() const { return inode_; }  // of the object made or opened
  bool created() const { return created_; }  // made by this process (not opened)
  void set_unlink_on_destroy(bool v) { unlink_ = v; }

 private:
  SharedObject() = default;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::string name_;
  std::string dir_;
  uid_t owner_uid_ = 0;
  mode_t mode_ = 0;
  ino_t inode_ = 0;
  bool created_ = false;
  bool unlink_ = false;
};

// "kvtd_<uid>_<generation as 16 hex>_<what>": objects that belong to one session (device arenas
// "dev<r>", host pools "host<r>", caches a daemon exports for FastDeploy's worker "fdcache<n>"),
// so a sweep can tell whose they are.
std::string session_object_name(std::uint64_t generation, const std::string& what);

// Free bytes of the file system that backs POSIX shared memory (/dev/shm), or -1.
std::int64_t shm_free_bytes();

// Removes shared-memory objects of this uid that no live process needs: session segments whose
// creator is dead, and device arenas and host pools ("kvtd_<uid>_<generation>_dev<r>" /
// "_host<r>") of sessions that no longer exist, in /dev/shm and in each of `object_dirs` (e.g. a
// hugetlbfs mount holding host pools). Returns the names removed. Safe to run while sessions are
// being created: it sweeps nothing while any segment is half-initialised. A host pool stays while
// the daemon its header names as holder (proto::HostPoolPrefix) lives: a daemon keeps its dead
// engine's pool for the engine's restart to take over (SessionHeader::take_over_host_tier).
std::vector<std::string> sweep_stale_objects(const std::vector<std::string>& object_dirs = {});

// Huge pages of `page_bytes` the kernel has free for new mappings (free minus reserved, from
// /sys/kernel/mm/hugepages), or -1 when it cannot tell.
std::int64_t free_huge_pages(std::uint64_t page_bytes);

}  // namespace kvtd::ipc
