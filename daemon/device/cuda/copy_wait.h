// How a copy lane waits for the work it enqueued. The daemon's context uses
// cudaDeviceScheduleBlockingSync (a waiting thread sleeps instead of spinning a core beside the
// engine), and on the H100 the wake-up from that sleep was most of a task's fixed cost: a
// one-block round trip took 125 us for about 42 us of copying. So a lane sleeps on the host until
// shortly before the copy should end (its bytes at the lane's recent rate), polls the stream,
// yielding the core between polls, for a bounded window around that end, and only then blocks in
// the driver. A pure function plans it; the backend (copy_wait.cpp) carries it out.
#pragma once

#include <cstdint>

namespace kvtd::daemon::cuda {

// Times from the moment the copy was enqueued. poll_until_ns == 0: block in the driver at once.
struct CopyWait {
  std::int64_t sleep_ns = 0;       // sleep on the host this long before the first poll
  std::int64_t poll_until_ns = 0;  // poll until this long after the enqueue, then block
};

// The rate assumed before a lane has measured one (the H100's link moved 45-53 GB/s).
inline constexpr double kFirstGuessBytesPerNs = 50.0;

// The wait for a copy of `bytes` on a lane that recently moved `bytes_per_ns` (<= 0: not yet
// known) with a poll window of `spin_ns` (<= 0: block at once, the old behaviour). The sleep ends
// half a window before the expected end, the polls half a window after it (at least one window).
CopyWait plan_copy_wait(std::uint64_t bytes, double bytes_per_ns, std::int64_t spin_ns);

// The lane's rate after a copy of `bytes` took `elapsed_ns` from enqueue to seen done: a moving
// average that copies under 4 MiB leave alone (their fixed costs would understate the link and
// make the next sleep overshoot). `done_at_first_look`: the first poll after the sleep found the
// copy done, so it ended at some unknown time before `elapsed_ns`, and the elapsed time is the
// sleep the estimate itself chose: such a copy only says the lane is at least this fast, and the
// rate grows by a quarter. Counting it as a measurement made a low estimate confirm itself (the
// H100, 2026-11-28: 16-block tasks at 9.0 GB/s with the poll window, 37.4 without it).
double next_copy_rate(double bytes_per_ns, std::uint64_t bytes, std::int64_t elapsed_ns, bool done_at_first_look);

}  // namespace kvtd::daemon::cuda
