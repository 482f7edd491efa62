// kvtd/proto/outcome.h - what one rank reports for a task: the fields of its completion record
// apart from the timing, as one value built by name (a swap's layers and a write's skipped keys
// are never mistaken for each other, and a failure names its status and cause).
//
// A plain value: copyable, movable, no invariants beyond "a failure carries a message".
#pragma once

#include <cstdint>
#include <string>

#include "kvtd/proto/task.h"

namespace kvtd::proto {

struct Outcome {
  TaskStatus status = TaskStatus::kOk;
  std::uint64_t blocks = 0;   // blocks done (MIN over ranks in the merged result)
  std::uint32_t layers = 0;   // layers done (swaps)
  std::uint64_t skipped = 0;  // keys not written (STORAGE_WRITE: stored already, or not selected)
  std::string message;        // empty on success

  // Success: `blocks` moved, found or loaded.
  static Outcome ok(std::uint64_t blocks = 0) { return Outcome{TaskStatus::kOk, blocks, 0, 0, {}}; }
  // Success with a note for the log and the engine ("mappings closed", "tensors re-opened").
  static Outcome done(std::string note, std::uint64_t blocks = 0) {
    return Outcome{TaskStatus::kOk, blocks, 0, 0, std::move(note)};
  }
  // A swap that moved `blocks` blocks of every one of `layers` layers.
  static Outcome swapped(std::uint64_t blocks, std::uint32_t layers) {
    return Outcome{TaskStatus::kOk, blocks, layers, 0, {}};
  }
  // A STORAGE_WRITE (or a backup) that wrote `written` objects and skipped `skipped` keys.
  static Outcome written(std::uint64_t written, std::uint64_t skipped) {
    return Outcome{TaskStatus::kOk, written, 0, skipped, {}};
  }
  // A failure with its cause; nothing usable was moved.
  static Outcome failed(TaskStatus status, std::string message) {
    return Outcome{status, 0, 0, 0, std::move(message)};
  }
  // Stopped part way (cancelled, the store failed mid-load): the first `blocks` are done.
  static Outcome stopped(TaskStatus status, std::uint64_t blocks, std::string message) {
    return Outcome{status, blocks, 0, 0, std::move(message)};
  }
  // The same with `n` keys counted as skipped (writes and backups).
  Outcome&& with_skipped(std::uint64_t n) && {
    skipped = n;
    return std::move(*this);
  }
};

}  // namespace kvtd::proto
