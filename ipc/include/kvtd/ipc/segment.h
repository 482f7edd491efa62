// kvtd/ipc/segment.h - the session layout arithmetic, its validation against a mapping, and a
// view whose pointers come from a validated private copy of the layout: the contract both ends
// (client/engine and daemon/endpoint) build on. Not part of the installed API.
//
// Shared memory is hostile input (rule 9): a daemon validates the header once at attach, in
// 64-bit checked arithmetic against the size of its mapping, keeps the result in private memory
// and never re-reads an offset, size or count from the header again. The engine keeps the
// layout it computed itself. Writing garbage over the header later therefore cannot move a
// pointer of either side.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvtd/ipc/errors.h"
#include "kvtd/ipc/shared_object.h"
#include "kvtd/proto/expected.h"
#include "kvtd/proto/session.h"

namespace kvtd::ipc::detail {

struct SessionLayout {
  std::uint64_t registry_offset = 0, registry_count = 0;
  std::uint64_t ring_offset = 0, ring_bytes = 0;
  std::uint64_t completion_offset = 0, completion_stride = 0;
  std::uint32_t completion_capacity = 0;
  std::uint64_t progress_offset = 0, progress_stride = 0;
  std::uint64_t agreement_offset = 0;
  std::uint64_t total_bytes = 0;
};

inline constexpr std::uint64_t kMinRingBytes = 4096;
inline constexpr std::uint64_t kMaxRingBytes = 1ull << 30;
inline constexpr std::uint32_t kMaxCompletionCapacity = 1u << 20;

// "" when ring and completion sizes are in range (powers of two), else the problem.
std::string check_ring_sizes(std::uint64_t ring_bytes, std::uint32_t completion_capacity);
// Layout of a session; only for values that passed proto::session_cache_problem and
// check_ring_sizes (a group session passes its envelope: only ranks and layers size the layout).
SessionLayout compute_layout(const proto::CacheGeometry& g, std::uint64_t ring_bytes,
                             std::uint32_t completion_capacity);

struct SessionView;

// Header initialisation, beside its validation below: constructs every control block of a fresh
// (zero-filled) segment in place, so each atomic begins its life as an object, writes the
// header (a random generation, the creator, the geometry, every offset of `view.layout`; state
// kCreating; the engine heartbeat at `now_ns`) and stores the magic last with release, so a
// daemon that acquires a non-zero magic sees every field. Returns the header.
// `groups`: the session's cache groups (all zero for a single-shape geometry; then `g` is the
// geometry, else `g` is proto::envelope_of(groups)).
proto::SessionHeader* init_session(const SessionView& view, const proto::CacheGeometry& g,
                                   const proto::CacheGroups& groups, std::uint32_t completion_capacity,
                                   std::int64_t now_ns);

// The fields of a header that define its layout, copied out of shared memory once.
struct HeaderCopy {
  std::uint32_t layout_version = 0, header_bytes = 0, completion_capacity = 0;
  std::uint64_t generation = 0;
  std::uint32_t creator_pid = 0;          // proto::SessionHeader::creator_pid
  std::uint64_t take_over_host_tier = 0;  // proto::SessionHeader::take_over_host_tier
  std::uint32_t served_ranks = 0;         // proto::SessionHeader::served_ranks
  proto::KvIdentity kv_identity{};        // proto::SessionHeader::kv_identity
  std::uint64_t engine_pid_namespace = 0; // proto::SessionHeader::engine_pid_namespace
  proto::CacheGeometry geometry{};
  proto::CacheGroups groups{};
  std::uint64_t registry_offset = 0, registry_count = 0, task_ring_offset = 0, task_ring_bytes = 0;
  std::uint64_t completion_offset = 0, completion_stride = 0, total_bytes = 0;
  std::uint64_t progress_offset = 0, progress_stride = 0;
};
HeaderCopy copy_header(const proto::SessionHeader& h);

// Checks a copied header against a mapping of `mapping_bytes`: version, geometry, ring sizes,
// and every offset, stride and count equal to what the geometry implies and inside the mapping.
// Returns the layout to use from now on, or kBadMagic/kBadVersion naming the field.
Result<SessionLayout, IpcErrc> validate_header(const HeaderCopy& h, std::uint64_t mapping_bytes);

// Pointers into a mapped session, computed from a validated layout.
struct SessionView {
  std::byte* base = nullptr;
  SessionLayout layout;
  std::uint32_t num_ranks = 0;
  std::uint32_t num_layers = 0;

  proto::SessionHeader* header() const { return reinterpret_cast<proto::SessionHeader*>(base); }
  proto::TensorDesc* registry() const { return reinterpret_cast<proto::TensorDesc*>(base + layout.registry_offset); }
  std::byte* ring() const { return base + layout.ring_offset; }
  proto::CompletionRingControl* completion_control(std::uint32_t rank) const {
    return reinterpret_cast<proto::CompletionRingControl*>(base + layout.completion_offset +
                                                           rank * layout.completion_stride);
  }
  proto::CompletionRecord* completion_records(std::uint32_t rank) const {
    return reinterpret_cast<proto::CompletionRecord*>(reinterpret_cast<std::byte*>(completion_control(rank)) +
                                                      sizeof(proto::CompletionRingControl));
  }
  proto::ProgressControl* progress_control(std::uint32_t rank) const {
    return reinterpret_cast<proto::ProgressControl*>(base + layout.progress_offset + rank * layout.progress_stride);
  }
  proto::LayerProgressSlot* progress_slot(std::uint32_t rank, std::uint64_t seq) const {
    return reinterpret_cast<proto::LayerProgressSlot*>(progress_control(rank) + 1) + seq % proto::kProgressSlots;
  }
  std::uint8_t* event_handle(std::uint32_t rank, std::uint32_t layer) const {
    return reinterpret_cast<std::uint8_t*>(reinterpret_cast<proto::LayerProgressSlot*>(progress_control(rank) + 1) +
                                           proto::kProgressSlots) +
           std::size_t{layer} * proto::kHandleBytes;
  }
  proto::AgreementControl* agreement_control() const {
    return reinterpret_cast<proto::AgreementControl*>(base + layout.agreement_offset);
  }
  std::atomic<std::uint64_t>* agreement_slot(std::uint32_t rank, std::uint64_t seq) const {
    return reinterpret_cast<std::atomic<std::uint64_t>*>(agreement_control() + 1) +
           std::size_t{rank} * proto::kAgreementSlots + seq % proto::kAgreementSlots;
  }
};

// "kvtd_<uid>_<suffix>"; the suffix is checked by proto::valid_session_suffix.
std::string session_name(const std::string& suffix);
using ipc::session_object_name;

// Whether a session's creator (or any process `pid`) may still run: not only when it is known
// gone (ESRCH). A pid of 0 or less is gone.
bool process_alive(pid_t pid);
// Whether the engine that created session segment `seg` lives, and who it is in words. Its
// lock on the segment (ipc/liveness_lock.h) answers in every pid namespace; a segment of an
// older layout, or one whose lock cannot be asked, falls back to its creator_pid in this
// namespace. A segment too short for a header has no creator (not alive).
struct CreatorLiveness {
  bool alive = false;
  std::string who = "no creator recorded";
};
CreatorLiveness creator_liveness(const SharedObject& seg);
// sweep_stale_objects, calling `after_judging` (tests: a new engine taking a dead session's name
// right there) between judging which sessions are dead and removing them.
std::vector<std::string> sweep_stale_objects_judged(const std::vector<std::string>& object_dirs,
                                                    const std::function<void()>& after_judging);

// Names the first geometry field on which `have` and `want` differ, or "" when equal.
std::string geometry_mismatch(const proto::CacheGeometry& have, const proto::CacheGeometry& want);
// Names the first cache group on which `have` and `want` differ (its kind, layers, block counts,
// tensors), or "" when equal.
std::string groups_mismatch(const proto::CacheGroups& have, const proto::CacheGroups& want);
std::string errno_text(const char* what);
// "rank 3" or "ranks 0,2" for a served_ranks mask (proto::SessionHeader::served_ranks).
std::string ranks_text(std::uint32_t mask);

}  // namespace kvtd::ipc::detail
