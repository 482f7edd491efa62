// libFuzzer target: FastDeploy's version.yaml as kvtd reads it (kvtd/config/version_yaml.h). Any
// input must end in a version or an error message: no crash, no exception escaping, no UB; and a
// version read is a string FastDeploy's prefix rule applies to.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvtd/config/version_yaml.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto v = kvtd::config::version_from_yaml(text);
  if (v.ok()) (void)kvtd::config::key_prefix_of_version(*v);
  return 0;
}
