// block_counts.h (daemon-internal) - per block, how many tasks of a set read it and how many
// write it: the one conflict rule, shared by the block tracker (tasks in flight, per lane) and
// the parked queue (tasks waiting to be admitted, in ring order).
//
// A task conflicts with the set when it writes a block some task of the set reads or writes, or
// reads a block some task of the set writes: two readers never conflict.
//
// Thread-safety: none; its owner locks. Copyable (a plain value).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kvtd::daemon {

// The blocks and ids of one task, as the tracker sees them. Spans: the task's own vectors, which
// must outlive every use of this view.
struct TrackedTask {
  std::uint64_t task_id = 0;
  std::uint64_t after_task_id = 0;  // 0: none
  std::span<const std::int32_t> host_ids;
  std::span<const std::int32_t> device_ids;
  bool reads_host = false;    // it only reads its host blocks (else it writes them)
  bool reads_device = false;  // it only reads its device blocks
};

class BlockCounts {
 public:
  // Ids must be within [0, host_blocks) and [0, device_blocks) (the decoder checked them).
  BlockCounts(std::int64_t host_blocks, std::int64_t device_blocks);

  bool collides(const TrackedTask& t) const;
  void add(const TrackedTask& t) { count(t, +1); }
  void remove(const TrackedTask& t) { count(t, -1); }

 private:
  // Counts, not flags: a set may hold many tasks on a block (32 bits: no realistic queue wraps).
  struct Side {
    std::vector<std::uint32_t> readers, writers;
  };
  static bool collide(const Side& side, std::span<const std::int32_t> ids, bool reads);
  static void count(Side& side, std::span<const std::int32_t> ids, bool reads, int delta);
  void count(const TrackedTask& t, int delta);

  Side host_, device_;
};

}  // namespace kvtd::daemon
