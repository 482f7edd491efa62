// A copy through memory the engine can shrink, made survivable. The host backend maps the
// engine's memory (a /dev/shm arena, a memfd of sglang's host pool); an engine that truncates it
// after attach turns the next access into SIGBUS, which killed the daemon, and its restart then
// refused the smaller file, in a loop. Inside `survive_bus_error` a SIGBUS on the calling thread
// ends the copy instead: the caller fails its task and serves on.
//
// Contract for `copy`: plain loads and stores (memcpy loops) with no lock held and no object
// with a destructor alive in its frames, since a bus error leaves them by siglongjmp.
// Thread-safety: any thread; the guard is per thread and does not nest.
#pragma once

#include <cstdint>
#include <optional>

namespace kvtd::daemon {

// Runs copy(arg). Returns the faulting address if a SIGBUS on this thread ended it early.
std::optional<std::uintptr_t> survive_bus_error(void (*copy)(void*), void* arg);

// The same for a callable held by reference (no copy, no allocation).
template <typename F>
std::optional<std::uintptr_t> survive_bus_error(F& copy) {
  return survive_bus_error([](void* f) { (*static_cast<F*>(f))(); }, &copy);
}

}  // namespace kvtd::daemon
