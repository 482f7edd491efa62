// kvtd/ctl/ctl.h - `kvtd ctl`: the operator's client of a daemon's control socket (status, drain,
// log-level, clear, restore), run by the kvtd binary; no part of the daemon's library.
#pragma once

namespace kvtd::ctl {

// Runs `kvtd ctl <command> [flags]` (argv[0] is "ctl"); prints the reply as JSON. Exit 0 when the
// daemon answered ok, 1 when it answered an error or could not be reached, 2 for bad flags.
int run_ctl(int argc, char** argv);

}  // namespace kvtd::ctl
