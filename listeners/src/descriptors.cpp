#include "kvtd/listeners/descriptors.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

namespace kvtd::listeners {

Result<DescriptorLimit, ListenErrc> raise_descriptor_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0)
    return make_error(ListenErrc::kSystem, std::string("getrlimit(RLIMIT_NOFILE): ") + std::strerror(errno));
  DescriptorLimit out;
  out.was = r.rlim_cur;
  const rlim_t want = r.rlim_max == RLIM_INFINITY ? kDescriptorCeiling
                                                  : std::min<rlim_t>(r.rlim_max, kDescriptorCeiling);
  if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < want) {
    r.rlim_cur = want;
    if (::setrlimit(RLIMIT_NOFILE, &r) != 0)
      return make_error(ListenErrc::kSystem,
                        fmt::format("setrlimit(RLIMIT_NOFILE, {}): {}", want, std::strerror(errno)));
  }
  out.now = r.rlim_cur;
  return out;
}

}  // namespace kvtd::listeners
