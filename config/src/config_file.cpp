// The config file (--config, or the instance's under --config-dir), checked before CLI11 reads it:
// CLI11 reads whatever the path names, so a FIFO hung start-up and a table nested thousands deep
// took 3.9 GB. A config file is a small regular file of flat flags (kvtd.toml.example).
#include <cerrno>
#include <algorithm>
#include <cstring>
#include <fmt/format.h>
#include <string>

#include "flag_groups.h"
#include "small_file.h"

namespace kvtd::config {
namespace {

constexpr long long kMaxConfigBytes = 1 << 20;
constexpr int kMaxNesting = 8;  // dotted parts of a key or table name, or brackets open at once

// The deepest nesting on one line: the dotted parts of its table header or key, or the brackets
// and braces its value opens at once (quoted text and comments skipped).
int nesting_of(const std::string& line) {
  int depth = 0, deepest = 0, dots = 0;
  char quote = 0;
  bool in_name = true;  // a header's name, or the key before '='
  const auto first = line.find_first_not_of(" \t");
  const bool header = first != std::string::npos && line[first] == '[';
  for (std::size_t i = header ? first + 1 : 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quote) {
      if (c == quote) quote = 0;
      continue;
    }
    if (c == '#') break;
    if (c == '"' || c == '\'') quote = c;
    else if (in_name && c == '.') ++dots;
    else if (header && c == ']') in_name = false;
    else if (!header && c == '=') in_name = false;
    else if (!in_name && (c == '[' || c == '{')) deepest = std::max(deepest, ++depth);
    else if (!in_name && (c == ']' || c == '}')) --depth;
  }
  return std::max(deepest, dots + 1);
}

}  // namespace

Status<ConfigErrc> check_config_file(const std::string& path) {
  auto bad = [&](const std::string& why) { return make_error(ConfigErrc::kInvalidValue, "config file " + path + ": " + why); };
  const SmallFile f = read_small_regular_file(path, kMaxConfigBytes);
  if (!f.problem.empty()) return bad(f.problem);
  const std::string& text = f.text;
  std::size_t line_no = 0, at = 0;
  while (at <= text.size()) {
    const auto nl = text.find('\n', at);
    const std::string line = text.substr(at, nl == std::string::npos ? std::string::npos : nl - at);
    ++line_no;
    if (nesting_of(line) > kMaxNesting)
      return bad(fmt::format("line {} nests deeper than {} levels; kvtd's flags are flat (see kvtd.toml.example)",
                             line_no, kMaxNesting));
    if (nl == std::string::npos) break;
    at = nl + 1;
  }
  return {};
}

}  // namespace kvtd::config
