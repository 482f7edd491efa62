// Internal: a named POSIX shared-memory object mapped read-write (Boost.Interprocess), plus the
// session layout arithmetic. Not part of the public API.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kvtd/ipc/errors.h"
#include "kvtd/proto/expected.h"
#include "kvtd/proto/session.h"

namespace kvtd::ipc::detail {

struct SharedMapping {
  SharedMapping() = default;
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  ~SharedMapping();

  std::byte* data = nullptr;
  std::size_t size = 0;
  std::string name;
  uid_t owner_uid = 0;
  mode_t mode = 0;
  bool owner = false;  // created by us: unlinked on destruction
  std::shared_ptr<void> region;  // the Boost mapped_region, type-erased to keep Boost out
};

// Creates a new object of `bytes` (mode 0600), zero-filled, and maps it.
Result<std::unique_ptr<SharedMapping>, IpcErrc> create_mapping(const std::string& name, std::size_t bytes);
// Maps an existing object; records its owner and mode for the caller to check.
Result<std::unique_ptr<SharedMapping>, IpcErrc> open_mapping(const std::string& name);
// Unlinks a name (ignores a missing one).
void remove_mapping(const std::string& name);

struct SessionLayout {
  std::uint64_t registry_offset, registry_count;
  std::uint64_t ring_offset, ring_bytes;
  std::uint64_t completion_offset, completion_stride;
  std::uint32_t completion_capacity;
  std::uint64_t progress_offset, progress_stride;
  std::uint64_t total_bytes;
};
SessionLayout compute_layout(const proto::CacheGeometry& g, std::uint64_t ring_bytes,
                             std::uint32_t completion_capacity);

// "kvtd_<uid>_<suffix>"; the suffix is checked by proto::valid_session_suffix.
std::string session_name(const std::string& suffix);

// Pointers into a mapped session.
inline proto::TensorDesc* registry(proto::SessionHeader* h) {
  return reinterpret_cast<proto::TensorDesc*>(reinterpret_cast<std::byte*>(h) + h->registry_offset);
}
inline std::byte* ring_bytes(proto::SessionHeader* h) {
  return reinterpret_cast<std::byte*>(h) + h->task_ring_offset;
}
inline proto::CompletionRingControl* completion_control(proto::SessionHeader* h, std::uint32_t rank) {
  return reinterpret_cast<proto::CompletionRingControl*>(reinterpret_cast<std::byte*>(h) + h->completion_offset +
                                                         rank * h->completion_stride);
}
inline proto::CompletionRecord* completion_records(proto::SessionHeader* h, std::uint32_t rank) {
  return reinterpret_cast<proto::CompletionRecord*>(reinterpret_cast<std::byte*>(completion_control(h, rank)) +
                                                    sizeof(proto::CompletionRingControl));
}

inline proto::ProgressControl* progress_control(proto::SessionHeader* h, std::uint32_t rank) {
  return reinterpret_cast<proto::ProgressControl*>(reinterpret_cast<std::byte*>(h) + h->progress_offset +
                                                   rank * h->progress_stride);
}
inline proto::LayerProgressSlot* progress_slot(proto::SessionHeader* h, std::uint32_t rank, std::uint64_t seq) {
  return reinterpret_cast<proto::LayerProgressSlot*>(progress_control(h, rank) + 1) + seq % proto::kProgressSlots;
}
inline std::uint8_t* event_handle(proto::SessionHeader* h, std::uint32_t rank, std::uint32_t layer) {
  return reinterpret_cast<std::uint8_t*>(reinterpret_cast<proto::LayerProgressSlot*>(progress_control(h, rank) + 1) +
                                         proto::kProgressSlots) +
         std::size_t{layer} * proto::kHandleBytes;
}

// Names the first geometry field on which `have` and `want` differ, or "" when equal.
std::string geometry_mismatch(const proto::CacheGeometry& have, const proto::CacheGeometry& want);
std::string errno_text(const char* what);

}  // namespace kvtd::ipc::detail
