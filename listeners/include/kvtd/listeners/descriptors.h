// kvtd/listeners/descriptors.h - the process's descriptor limit. systemd's default soft limit is
// 1,024 (hard 524,288): a daemon that kept it ran out of descriptors once anyone held ~1,100
// connections to its listeners, and then failed storage tasks and aborted inside libzmq. The
// daemon raises the soft limit to the hard one at start; every listener's connections are capped
// far below it (ZmqListenerGuard, the metrics server), so what is left stays in reserve for the
// store, the shared memory and the sessions.
#pragma once

#include <cstdint>

#include "kvtd/proto/expected.h"
#include "kvtd/listeners/zmq_listener_guard.h"

namespace kvtd::listeners {

struct DescriptorLimit {
  std::uint64_t was = 0;  // the soft limit found
  std::uint64_t now = 0;  // the soft limit after raising it (at most kDescriptorCeiling)
};

// No more than this is asked for: poll sets and tables sized by the limit stay small.
inline constexpr std::uint64_t kDescriptorCeiling = 1u << 20;

// Raises the soft RLIMIT_NOFILE to the hard limit (or the ceiling). Fails only if setrlimit does.
Result<DescriptorLimit, ListenErrc> raise_descriptor_limit();

}  // namespace kvtd::listeners
