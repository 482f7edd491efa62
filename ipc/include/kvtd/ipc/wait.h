// kvtd/ipc/wait.h - bounded waits on 32-bit futex words in shared memory.
//
// Pattern: read the word, check the condition, then wait_on_word(word, seen, deadline). The
// waiter first polls for up to `spin_ns`, yielding the core between polls (cheap when the event
// is microseconds away), then sleeps in the kernel with FUTEX_WAIT (shared, not PRIVATE: the
// word lives in a mapping shared by processes).
// A waker bumps the word and calls wake_word only if the waiter count it maintains is nonzero.
// There is no lock anywhere, so a dead process cannot wedge the others.
//
// Thread-safety: all functions are safe from any thread and process.
#pragma once

#include <atomic>
#include <cstdint>

namespace kvtd::ipc {

enum class WaitResult { kChanged, kTimedOut };

// How long wait_on_word polls before it sleeps, unless told otherwise.
inline constexpr std::int64_t kDefaultSpinNs = 20'000;

// Returns kChanged once *word != seen (or on a spurious wake-up, which callers treat the same:
// they re-check their condition), kTimedOut once CLOCK_MONOTONIC passes deadline_ns.
// `spin_ns` bounds the polling before sleeping. `waiters` (may be null) is incremented while
// this call sleeps, so wakers can skip the system call when nobody sleeps.
WaitResult wait_on_word(const std::atomic<std::uint32_t>& word, std::uint32_t seen,
                        std::int64_t deadline_ns, std::atomic<std::uint32_t>* waiters,
                        std::int64_t spin_ns = kDefaultSpinNs);

// Bumps *word and wakes every sleeper if `waiters` says there may be one.
void bump_and_wake(std::atomic<std::uint32_t>& word, const std::atomic<std::uint32_t>* waiters);
// Wakes every sleeper on *word without changing it (they see a spurious wake-up and re-check),
// if `waiters` says there may be one. A hint only: a waiter between counting itself in `waiters`
// and entering the kernel misses it (the word did not change), so it sleeps on until the word
// changes or its deadline; callers must be correct without the wake.
void wake_sleepers(const std::atomic<std::uint32_t>& word, const std::atomic<std::uint32_t>* waiters);

}  // namespace kvtd::ipc
