// kvtd/daemon/engine_memory.h - the host backend's tensors are shared-memory objects by name, or
// memory an engine made without a name (sglang's memfd host pool) named "/proc/<pid>/fd/<fd>".
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace kvtd::daemon {

// The pid of a handle of the exact form "/proc/<pid>/fd/<fd>", else nullopt (a shared-memory
// object name, or a malformed form, which the host backend's open_tensor refuses by name). Pure.
std::optional<std::uint32_t> engine_memory_pid(std::string_view handle);

}  // namespace kvtd::daemon
