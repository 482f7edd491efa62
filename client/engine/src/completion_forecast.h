// completion_forecast.h (client/engine internal) - when a swap should report, from the daemons'
// own timing of the last swap of its direction, so that a caller waiting for it polls around that
// time instead of sleeping through the report: a sleeping waiter's wake-up cost 24-48 us of a
// 16-block task's ~900 us round trip on an H100 (docs/gpu.md, "Through one daemon").
//
// The forecast is built from the ranks' CLOCK_MONOTONIC stamps in their reports (when the first
// began, when the last reported), never from when the caller noticed, so a late wake-up cannot
// feed back into it (the copy lanes' poll window once confirmed its own bad estimate that way).
//
// Thread-safety: none (a value, kept under the session's mutex). Copyable and movable.
#pragma once

#include <cstdint>
#include <optional>

#include "kvtd/proto/task.h"

namespace kvtd::engine {

class CompletionForecast {
 public:
  // A swap of `kind` naming `blocks` blocks completed ok: submitted at `submit_ns` (the session's
  // clock), its first rank began at `start_ns`, its last rank reported at `end_ns`.
  void learn(proto::TaskKind kind, std::uint64_t blocks, std::int64_t submit_ns, std::int64_t start_ns,
             std::int64_t end_ns);
  // When a swap of `kind` naming `blocks` blocks, submitted at `submit_ns`, should have its last
  // report: the last one of its direction scaled by its blocks. nullopt before one was learned,
  // and for every other kind (storage tasks wait on disks and peers, not on a rate).
  std::optional<std::int64_t> end_of(proto::TaskKind kind, std::uint64_t blocks, std::int64_t submit_ns) const;

  // A swap's direction: 0 device->host, 1 host->device; -1 for every other kind.
  static int direction(proto::TaskKind kind);

 private:
  struct Last {
    std::uint64_t blocks = 0;  // 0: none learned
    std::int64_t lead_ns = 0;  // submit -> first start
    std::int64_t exec_ns = 0;  // first start -> last report
  };
  Last last_[2];
};

// How to wait for a report forecast at `end_ns` for a task submitted at `submit_ns`: sleep until
// `sleep_until_ns` (nothing to sleep when it is not after now), then poll until `poll_until_ns`,
// then sleep as before. The window is an eighth of the forecast time, 40-400 us, centred on it.
struct CompletionWait {
  std::int64_t sleep_until_ns = 0;
  std::int64_t poll_until_ns = 0;
};
CompletionWait plan_completion_wait(std::int64_t submit_ns, std::int64_t end_ns);

// Where a waiter took a forecast swap's result, by the session's clock when it took it: before
// the window (it slept, and was woken by the report), inside it (polling: no wake-up paid), or
// after it (it went back to sleep and was woken: the forecast was early, or the report late).
enum class WaitLanding { kBeforeWindow, kInWindow, kAfterWindow };
WaitLanding landing_of(const CompletionWait& w, std::int64_t taken_ns);

}  // namespace kvtd::engine
