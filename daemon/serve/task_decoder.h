// task_decoder.h (daemon-internal) - what one task record copied out of the ring asks of the
// dispatcher: a pure function of the record, the cache's shape and the time, so every rule (ids,
// counts, keys, deadlines, which kinds carry what) is unit-tested without a session.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kvtd/proto/task.h"
#include "work.h"

namespace kvtd::daemon {

// One cache group's share of the id spaces and its per-tensor block bytes.
struct GroupShape {
  std::int64_t device_base = 0, device_blocks = 0;  // ids [base, base + blocks) on each side
  std::int64_t host_base = 0, host_blocks = 0;
  std::span<const std::uint64_t> block_bytes;  // per tensor of a layer
};

// The block counts and per-tensor block bytes a task is checked against.
struct CacheShape {
  std::int64_t device_blocks = 0;  // ids a swap may use (every group's): valid in every layer
  std::int64_t host_blocks = 0;
  std::span<const GroupShape> groups;  // at least one; one group: bases 0 and the totals above
  std::uint32_t rank = 0;       // whose engine event of a swap's per-rank list is this daemon's
  std::uint32_t num_ranks = 1;  // how many the list must hold
  bool group_session = false;   // storage tasks name a block per key and group (-1: none)
};

struct DecodedRecord {
  enum class Action {
    kRun,      // `work` is a valid swap or storage task
    kFail,     // complete it with `status` / `message` (and abort its agreement if told so)
    kClear,    // CLEAR_CACHE: drain, then close the mappings
    kRestore,  // RESTORE_CACHE while serving: answered ok
    kCancel,   // CANCEL of `cancel_task_id`
  };
  Action action = Action::kFail;
  Work work;  // header always (as far as the record had one); kRun: the whole task
  proto::TaskStatus status = proto::TaskStatus::kOk;
  std::string message;
  bool abort_agreement = false;   // kFail of a storage task: the peers must stop waiting for it
  std::uint64_t cancel_task_id = 0;
};

// Decodes and validates `record` (hostile input: every count checked) at time `now_ns`.
DecodedRecord decode_record(std::span<const std::byte> record, const CacheShape& shape, std::int64_t now_ns);

}  // namespace kvtd::daemon
