// small_file.h (config internal) - reading a file kvtd expects to be small and regular (a config
// file, FastDeploy's version.yaml) without trusting what the path names: opened non-blocking, so
// a FIFO or a device in its place never blocks, and read only when it is a regular file of at
// most `max_bytes`.
#pragma once

#include <optional>
#include <string>

namespace kvtd::config {

struct SmallFile {
  bool missing = false;   // ENOENT: no such file (not an error for every caller)
  std::string text;       // the content, when read
  std::string problem;    // else why not: "not a regular file", its size past the bound, strerror
};

SmallFile read_small_regular_file(const std::string& path, long long max_bytes);

}  // namespace kvtd::config
