// kvtd/daemon/selftest.h - `kvtd selftest`: runs every copy-plan shape (runs only, scattered
// only, mixed; all layers and layer by layer; the layout transform) through a device backend in
// every scatter mode, checks the bytes against the host executor, and prints GB/s per direction
// and mode. With --device-backend cuda on a machine without a usable GPU it says so and exits
// kSelftestUnavailable.
#pragma once

namespace kvtd::daemon {

inline constexpr int kSelftestUnavailable = 77;

// argv[0] is "selftest". Returns the process exit code: 0 all checks passed, 1 a check failed,
// 2 bad flags, kSelftestUnavailable backend not usable here.
int run_selftest(int argc, char** argv);

}  // namespace kvtd::daemon
