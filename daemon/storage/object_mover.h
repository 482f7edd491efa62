// object_mover.h (daemon/storage private) - phase 2 of a storage task, on an I/O worker: the
// agreed objects between the blocks and the store, through the worker's staging slice, in steps
// of at most ~4 MiB with the cancel, revocation and deadline checks between them. It reports
// what the task did as an Outcome and leaves completing it to its caller.
//
// Thread-safety: load() and write() run on several workers at once, each with its own slice;
// stats() from any thread. Not copyable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/storage_executor.h"
#include "kvtd/storage/object_store.h"
#include "task_queues.h"

namespace kvtd::daemon {

// Each part's share of `tensors`: part p of `parts` is the p-th equal share of every tensor's
// block (a run of heads; kvtd/proto/object_slices.h), at the tensor's stride.
std::vector<std::vector<kernels::LayerTensor>> part_views(std::span<const kernels::LayerTensor> tensors,
                                                          std::uint32_t parts);

// Where a run of objects goes: the store of their namespace and, for object i, view i % views
// of block ids[i / views] (a single-shape session's parts; a cache group's one view).
struct ObjectTarget {
  storage::ObjectStore* store = nullptr;
  const std::vector<std::vector<kernels::LayerTensor>>* views = nullptr;
  std::uint64_t object_bytes = 0;
};

// Units [from, to) of a group session's task, all of cache group `group`: one step's objects.
struct GroupRun {
  std::uint32_t group = 0;
  std::size_t from = 0, to = 0;
};

class ObjectMover {
 public:
  // `targets`, `copies`, `pool`, `queues` and `ep` outlive the mover; `chunk_objects` objects fit
  // one worker's slice.
  ObjectMover(const StorageTargets& targets, CopyEngine& copies, HostPool* pool, TaskQueues& queues,
              endpoint::RankEndpoint& ep, std::size_t chunk_objects)
      : t_(targets),
        copies_(copies),
        pool_(pool),
        queues_(queues),
        ep_(ep),
        chunk_objects_(chunk_objects),
        device_parts_(part_views(targets.device_tensors, targets.slicing.parts)),
        host_parts_(part_views(targets.host_tensors, targets.slicing.parts)) {
    for (const GroupStorage& g : targets.groups) {
      group_device_.push_back({g.device_tensors});
      group_host_.push_back({g.host_tensors});
    }
  }
  ObjectMover(const ObjectMover&) = delete;
  ObjectMover& operator=(const ObjectMover&) = delete;

  // STORAGE_READ and PREFETCH: loads the agreed prefix of `p` through `slice`. The outcome to
  // report, or nullopt when the engine revoked the task (it has failed it already: no completion,
  // and no engine memory written after the check).
  std::optional<proto::Outcome> load(const Prepared& p, std::byte* slice);
  // STORAGE_WRITE: stores what is not stored yet, through `slice` or from the blocks in place.
  std::optional<proto::Outcome> write(const Prepared& p, std::byte* slice);

  struct Moved {
    std::uint64_t objects_read = 0, objects_written = 0, bytes_read = 0, bytes_written = 0;
  };
  Moved stats() const EXCLUDES(mu_);

  // Why this rank's work must stop without a completion: the engine revoked its epoch.
  bool revoked(const StorageWork& w) const { return w.epoch != ep_.epoch() || !ep_.granted(); }

 private:
  // What a step of a load or write ended with: results per object, or the task's outcome.
  struct Step {
    std::vector<storage::KeyResult> keys;
    std::optional<proto::Outcome> ended;
  };
  std::size_t cancel_step() const;
  // The target of a single-shape task's objects (its parts, on the device or in the host pool).
  ObjectTarget parts_target(bool host) const {
    return {t_.store, host ? &host_parts_ : &device_parts_, t_.object_bytes};
  }
  // Blocks `ids` from `objects` (target.views per block, block by block).
  Step load_chunk(const ObjectTarget& target, bool host, std::span<const std::int32_t> ids,
                  std::span<const std::string> objects, std::byte* slice);

  // ---- A group session's tasks (group_objects.cpp): every unit's object in its group's store ----
  std::optional<proto::Outcome> load_groups(const Prepared& p, std::byte* slice);
  std::optional<proto::Outcome> write_groups(const Prepared& p, std::byte* slice);
  // `p`'s units cut into runs of one group, each at most what a slice holds and a cancel step moves.
  std::vector<GroupRun> group_runs(const Prepared& p) const;
  ObjectTarget group_target(std::uint32_t g, bool host) const {
    return {t_.groups[g].store, host ? &group_host_[g] : &group_device_[g], t_.groups[g].object_bytes};
  }
  // The outcome of a load that stopped at object `at` of a step; nullopt if it is a miss.
  std::optional<proto::Outcome> failed_read(const Prepared& p, const storage::KeyResult& key, std::size_t loaded,
                                            std::size_t of) const;
  // Objects [from, from + c) of write `p`: nullopt when written, else the task's outcome.
  std::optional<proto::Outcome> write_chunk(const Prepared& p, std::size_t from, std::size_t c, bool in_place,
                                            std::byte* slice);
  // Blocks `ids` into `names` (target.views per block) from where they are or through `slice`.
  std::optional<proto::Outcome> write_objects(const ObjectTarget& target, bool host, std::span<const std::int32_t> ids,
                                              std::span<const std::string> names, bool in_place, std::byte* slice);
  std::optional<proto::Outcome> check_put(const storage::BatchResult& put, std::size_t c, std::uint64_t object_bytes);
  // A backup agreed but then held past --storage-backup-max-age-ms waiting for a write worker:
  // its backup_skipped outcome; nullopt otherwise.
  std::optional<proto::Outcome> stale_backup(const Prepared& p) const;
  std::optional<proto::Outcome> past_deadline(const StorageWork& w, std::size_t done, std::size_t of) const;
  // Whether the store writes objects straight from the blocks (and loads read into them in place):
  // for the daemon's own host pool only. The engine's memory, host memory included (host-backend
  // tensors: sglang's memfd pool, a /dev/shm arena), goes through the backend's copies, which
  // survive the engine shrinking its file under them (bus_error_guard.h); the store's hash or copy
  // of a page past the new end would be a SIGBUS that kills the daemon.
  bool stores_in_place(bool host) const;
  // The cause first, the store (whose name may hold a long path) last: completion messages are
  // cut at 167 characters.
  std::string unavailable(const std::string& what) const { return what + " (" + t_.store_name + ")"; }

  const StorageTargets& t_;
  CopyEngine& copies_;
  HostPool* const pool_;
  TaskQueues& queues_;
  endpoint::RankEndpoint& ep_;
  const std::size_t chunk_objects_;
  // The tensors as the objects cut them: one view list per part (one part: the whole blocks).
  const std::vector<std::vector<kernels::LayerTensor>> device_parts_;
  const std::vector<std::vector<kernels::LayerTensor>> host_parts_;
  // A group session's: each group's tensors as its objects' one view.
  std::vector<std::vector<std::vector<kernels::LayerTensor>>> group_device_, group_host_;
  mutable Mutex mu_;
  Moved moved_ GUARDED_BY(mu_);
};

}  // namespace kvtd::daemon
