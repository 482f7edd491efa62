// programs.h - where the programs a test starts live. A staged build (../shared/gpu/stage.sh on a
// GPU machine, tests/gpu/check_staged_gpu_check.sh here) puts every program in one flat folder,
// away from the build path compiled into the test, so the environment comes first:
//   $KVTD_BINARY / $KVTD_LOADGEN   the program itself,
//   $KVTD_BIN_DIR/<name>            a folder holding it,
//   KVTD_BUILT_BINARY / KVTD_BUILT_LOADGEN   the build's own path (kvtd_uses_daemons in CMake).
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <string>

namespace kvtd::test {

// The path of program `name`: $env_var, else $KVTD_BIN_DIR/name when executable there, else
// `built`. Never empty when `built` is not.
inline std::string program_path(const char* env_var, const char* name, const char* built) {
  if (const char* p = std::getenv(env_var); p != nullptr && *p != '\0') return p;
  if (const char* dir = std::getenv("KVTD_BIN_DIR"); dir != nullptr && *dir != '\0') {
    std::string candidate = std::string(dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return built;
}

#ifdef KVTD_BUILT_BINARY
// The rank daemon, `kvtd`.
inline std::string kvtd_binary() { return program_path("KVTD_BINARY", "kvtd", KVTD_BUILT_BINARY); }
// The engine stand-in, `kvtd-loadgen`.
inline std::string loadgen_binary() { return program_path("KVTD_LOADGEN", "kvtd-loadgen", KVTD_BUILT_LOADGEN); }
#endif

}  // namespace kvtd::test
