// libFuzzer target: a session header as a daemon finds it in shared memory, plus the size of the
// mapping it came in. validate_header must refuse anything whose layout does not fit, and
// whatever it accepts must lie inside the mapping.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kvtd/ipc/segment.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using kvtd::proto::SessionHeader;
  if (size < 8) return 0;
  std::uint64_t mapping = 0;
  std::memcpy(&mapping, data, 8);
  alignas(64) static unsigned char raw[sizeof(SessionHeader)];
  std::memset(raw, 0, sizeof raw);
  std::memcpy(raw, data + 8, std::min(size - 8, sizeof raw));
  const auto* h = reinterpret_cast<const SessionHeader*>(raw);
  const auto copy = kvtd::ipc::detail::copy_header(*h);
  auto layout = kvtd::ipc::detail::validate_header(copy, mapping);
  if (!layout.ok()) return 0;
  const auto& l = *layout;
  const auto& g = copy.geometry;
  // Everything the daemon will dereference lies inside the mapping.
  const std::uint64_t registry_end = l.registry_offset + l.registry_count * sizeof(kvtd::proto::TensorDesc);
  const std::uint64_t ring_end = l.ring_offset + l.ring_bytes;
  const std::uint64_t completion_end = l.completion_offset + l.completion_stride * g.num_ranks;
  const std::uint64_t progress_end = l.progress_offset + l.progress_stride * g.num_ranks;
  const std::uint64_t agreement_end = l.agreement_offset + sizeof(kvtd::proto::AgreementControl) +
                                      std::uint64_t{g.num_ranks} * kvtd::proto::kAgreementSlots * 8;
  if (registry_end > mapping || ring_end > mapping || completion_end > mapping || progress_end > mapping ||
      agreement_end > mapping || l.agreement_offset < progress_end ||
      l.total_bytes > mapping || l.completion_stride < sizeof(kvtd::proto::CompletionRingControl) +
                                                           std::uint64_t{l.completion_capacity} * sizeof(kvtd::proto::CompletionRecord))
    std::abort();
  return 0;
}
