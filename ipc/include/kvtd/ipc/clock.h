// kvtd/ipc/clock.h - time source behind an interface, so tests can inject a frozen or skewed clock.
//
// All deadlines and heartbeats in kvtd are CLOCK_MONOTONIC nanoseconds, which every process on
// the machine shares. Thread-safety: implementations must be safe to call from any thread.
#pragma once

#include <cstdint>

namespace kvtd::ipc {

class Clock {
 public:
  virtual ~Clock() = default;
  // CLOCK_MONOTONIC nanoseconds (or the test's idea of it).
  virtual std::int64_t now_ns() const = 0;
};

// The real monotonic clock; a process-wide instance that is never destroyed.
const Clock& monotonic_clock();

// now + timeout without overflow: a huge or negative timeout saturates instead of wrapping into
// the past (or the far future).
constexpr std::int64_t deadline_after(std::int64_t now, std::int64_t timeout_ns) {
  if (timeout_ns <= 0) return now;
  std::int64_t out = 0;
  return __builtin_add_overflow(now, timeout_ns, &out) ? INT64_MAX : out;
}

// Reads CLOCK_MONOTONIC directly (for code that has no Clock injected, e.g. the hot path).
std::int64_t monotonic_now_ns();

}  // namespace kvtd::ipc
