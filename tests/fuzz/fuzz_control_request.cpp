// libFuzzer target: a control-socket request as any local process could send it. parse_request
// must turn every input into a request with a known command or an error: no crash, no
// exception escaping, no UB; an accepted request names a known command (and a known level).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kvtd/control/control.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto r = kvtd::control::parse_request(text);
  if (!r.ok()) {
    if (r.error().message.empty()) std::abort();
    return 0;
  }
  const auto& c = r->command;
  if (c != "status" && c != "drain" && c != "log-level" && c != "clear" && c != "restore") std::abort();
  if (c == "log-level" && r->level.empty()) std::abort();
  if (r->drop_host_tier && c != "clear") std::abort();
  return 0;
}
