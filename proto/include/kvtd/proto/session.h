// kvtd/proto/session.h - layout of the shared-memory session segment.
//
//   [SessionHeader][TensorDesc registry][task ring bytes][completion rings, one per rank]
//   [layer progress, one block per rank: control, progress slots, per-layer CUDA IPC events]
//   [agreement: control, then kAgreementSlots words per rank]
//
// Every region is addressed by a byte offset from the segment start (never a pointer), so each
// process may map the segment at a different address. Synchronisation is by the atomics below
// (lock-free, address-free on the platforms we build for) and futex words; there is no lock in
// shared memory, so a process that dies cannot wedge the others.
//
// Who writes what:
//   engine (single producer): header fields, registry, task ring bytes, ring_head, next_seq,
//     rank attach grants (attached_epoch, consumed reset), engine heartbeat, cache_state. The
//     registry is written only while no daemon may read it: before publish, or while the cache
//     is cleared (cache_state kCleared, every rank confirmed).
//   rank r daemon: ranks[r].{attach_request, pid, heartbeat_ns, ready_flags, consumed},
//     its completion ring head.
//   engine: completion ring tails.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "kvtd/proto/cache_groups.h"
#include "kvtd/proto/geometry.h"
#include "kvtd/proto/group_slots.h"
#include "kvtd/proto/kv_identity.h"
#include "kvtd/proto/task.h"

namespace kvtd::proto {

inline constexpr std::uint64_t kSessionMagic = 0x5353455344545640ULL;  // "@VTDSESS"
// 2: RankSlot::owner; 3: agreement region; 4: scale bytes, extra layers; 5: cache_state;
// 6: ProgressControl::events_epoch; 7: RankSlot::agreement_left; 8: SessionHeader::groups;
// 9: SessionHeader::take_over_host_tier (a flag the daemon acts on; was a dead generation);
// 10: SessionHeader::served_ranks; 11: SessionHeader::kv_identity, engine_pid_namespace,
// RankSlot::pid_namespace, liveness by locks on the segment (ipc/liveness_lock.h)
inline constexpr std::uint32_t kSessionLayoutVersion = 11;

static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

enum class SessionState : std::uint32_t { kCreating = 0, kReady = 1, kClosed = 2 };

// Whether the engine's KV tensors may be mapped (SessionHeader::cache_state). The engine sets
// kCleared before it submits CLEAR_CACHE and kLive (after re-registering its tensors) before it
// submits RESTORE_CACHE, both under the same lock as its attach grants: so a daemon that reads
// the word after its grant either sees the state the task ring will bring it to, or reads that
// task from the ring. A daemon maps the registry only while it reads kLive.
enum class CacheState : std::uint32_t { kLive = 0, kCleared = 1 };

enum ReadyFlag : std::uint32_t {
  kReadyCacheAttached = 1u << 0,  // rank mapped every tensor of its rank
  kReadyHostPool = 1u << 1,       // rank allocated its host pool
  // Its host pool is the one its daemon kept from this suffix's dead previous session
  // (SessionHeader::take_over_host_tier): the blocks that engine wrote stay loadable.
  kReadyHostTierTakenOver = 1u << 2,
};

// One registered cache tensor of one rank and layer.
struct TensorDesc {
  std::uint32_t valid;         // 1 once registered
  std::uint32_t rank;
  std::uint32_t layer;
  std::uint32_t kind;          // TensorKind
  std::uint32_t dtype;         // CacheDtype of the elements (scales: 0, 2-byte elements)
  std::int32_t device_id;      // CUDA ordinal in the engine's process; -1 for host-backend tensors
  std::uint32_t ndim;
  std::uint32_t pci_bus_id;    // the GPU's PCI address (proto/pci.h), 0 = unknown: then the ordinal
  std::int64_t shape[4];
  std::uint64_t bytes;         // bytes of this tensor
  std::uint64_t offset;        // byte offset of the tensor inside the allocation `handle` names
  std::uint8_t handle[kHandleBytes];  // opaque: cudaIpcMemHandle_t, or a shm object name
};
static_assert(std::is_standard_layout_v<TensorDesc>);
static_assert(sizeof(TensorDesc) == 144);
static_assert(offsetof(TensorDesc, handle) == 80);

// The descriptor of `rank`'s tensor of `kind` in `layer`, packed as the geometry says (shape,
// dtype, bytes; no handle, offset or device): what an engine registers for such a tensor, and
// what a daemon expects of one it opens by name.
inline TensorDesc describe_tensor(const CacheGeometry& g, std::uint32_t rank, std::uint32_t layer, TensorKind kind) {
  TensorDesc d{};
  const bool data = kind == TensorKind::kKey || kind == TensorKind::kValue;
  d.rank = rank;
  d.layer = layer;
  d.kind = static_cast<std::uint32_t>(kind);
  d.dtype = data ? g.dtype : 0;
  d.ndim = data ? 4 : 3;
  const std::int64_t* s = (kind == TensorKind::kKey || kind == TensorKind::kKeyScale) ? g.key_shape : g.value_shape;
  for (std::uint32_t i = 0; i < d.ndim; ++i) d.shape[i] = s[i];
  d.shape[0] = g.device_blocks(layer);
  d.bytes = g.block_bytes(kind) * static_cast<std::uint64_t>(g.device_blocks(layer));
  return d;
}

// A session with cache groups (SessionHeader::groups) describes each tensor by its group: slot
// `slot` of `layer` (group_slot) holds that group's tensor, [device_blocks, dims...] of
// element_bytes; dtype is the element bytes (no CacheDtype applies). A zero descriptor (rank,
// layer and kind only) when the slot is empty.
inline TensorDesc describe_group_tensor(const CacheGroups& gs, std::uint32_t rank, std::uint32_t layer,
                                        std::uint32_t slot) {
  TensorDesc d{};
  d.rank = rank;
  d.layer = layer;
  d.kind = slot;
  const GroupSlot at = group_slot(gs, layer, slot);
  if (at.group < 0) return d;
  const CacheGroup& c = gs.groups[at.group];
  const GroupTensor& t = c.tensors[at.tensor];
  d.dtype = t.element_bytes;
  d.ndim = t.ndim + 1;
  d.shape[0] = c.device_blocks;
  for (std::uint32_t i = 0; i < t.ndim && i + 1 < 4; ++i) d.shape[i + 1] = t.dims[i];
  d.bytes = group_tensor_block_bytes(t) * static_cast<std::uint64_t>(c.device_blocks);
  return d;
}

// The `geometry` a session with cache groups carries: the ranks and layers of its groups (what
// sizes the registry and the progress blocks), every other field 0. The groups say the rest.
constexpr CacheGeometry envelope_of(const CacheGroups& gs) {
  CacheGeometry g{};
  g.num_ranks = gs.num_ranks;
  g.num_layers = detail::layer_count(gs);
  return g;
}

inline bool is_group_session(const CacheGroups& gs) { return gs.num_groups != 0; }

// A registry slot in messages: its tensor kind ("key", ...) for a single shape, "slot k" for groups.
inline std::string slot_name(const CacheGroups& gs, std::uint32_t slot) {
  if (gs.num_groups != 0 || slot >= kTensorKinds) return "slot " + std::to_string(slot);
  return tensor_kind_name(static_cast<TensorKind>(slot));
}

// The descriptor a session's cache implies for registry slot (rank, layer, slot), whichever way
// the cache is described (slot = TensorKind for a single-shape geometry); bytes 0 when the
// slot holds no tensor.
inline TensorDesc expected_tensor(const CacheGeometry& g, const CacheGroups& gs, std::uint32_t rank,
                                  std::uint32_t layer, std::uint32_t slot) {
  if (is_group_session(gs)) return describe_group_tensor(gs, rank, layer, slot);
  const auto kind = static_cast<TensorKind>(slot);
  if (slot >= kTensorKinds || !g.has_tensor(kind)) {
    TensorDesc d{};
    d.rank = rank;
    d.layer = layer;
    d.kind = slot;
    return d;
  }
  return describe_tensor(g, rank, layer, kind);
}

// The one validation of what a session's header says its cache is: a single-shape geometry
// (groups all zero), or cache groups with their envelope as geometry. "" when valid.
inline std::string session_cache_problem(const CacheGeometry& g, const CacheGroups& gs) {
  if (!is_group_session(gs)) {
    const CacheGroups zero{};
    if (std::memcmp(&gs, &zero, sizeof gs) != 0) return "groups: num_groups is 0 but other fields are set";
    return geometry_problem(g);
  }
  if (auto why = geometry_problem(gs); !why.empty()) return "groups: " + why;
  const CacheGeometry want = envelope_of(gs);
  if (std::memcmp(&g, &want, sizeof g) != 0)
    return "geometry of a group session must carry only num_ranks " + std::to_string(want.num_ranks) +
           " and num_layers " + std::to_string(want.num_layers);
  return "";
}

struct alignas(64) RankSlot {
  // Written by the daemon.
  std::atomic<std::uint32_t> attach_request;  // epoch the daemon asks for (bumped per attach)
  std::atomic<std::uint32_t> pid;
  std::atomic<std::uint32_t> ready_flags;     // ReadyFlag bits
  std::atomic<std::uint32_t> leaving_epoch;   // set on orderly detach: that epoch serves no more
  std::atomic<std::int64_t> heartbeat_ns;     // CLOCK_MONOTONIC
  // Written by the engine.
  std::atomic<std::uint32_t> attached_epoch;  // epoch granted; 0 = never
  std::atomic<std::uint32_t> attached;        // 1 while the engine counts this rank as live
  // Written by the daemon that serves the rank (compare-and-swap): the one live owner, as
  // owner_word(pid, start time). A newcomer refuses while the owner lives and takes over a dead
  // owner's claim; the engine fences (kills) exactly this process before failing its tasks.
  std::atomic<std::uint64_t> owner;
  // Agreement slots this rank has left (see AgreementControl): it will never again read a peer's
  // slot for a task with ring seq below this. Written by the daemon; set by the engine at a grant
  // (to the next seq: a new epoch never reads older tasks). A rank overwrites its slot for seq S
  // only once every live peer's value passed S - kAgreementSlots, the slot's previous task.
  std::atomic<std::uint64_t> agreement_left;
  // The inode of the serving daemon's pid namespace (/proc/self/ns/pid; 0 unknown), written
  // before its attach request: the engine signals it (liveness by pid, fencing by pidfd) only
  // from the same namespace. Across namespaces liveness is the daemon's lock on the segment
  // (ipc/liveness_lock.h) and a silent daemon that holds it is unfenced, not dead.
  std::atomic<std::uint64_t> pid_namespace;
  std::uint8_t pad0[64 - 56];
  // Task ring read cursor (bytes consumed): written by the daemon, reset by the engine on grant.
  alignas(64) std::atomic<std::uint64_t> consumed;
  std::uint8_t pad1[56];
};
static_assert(std::is_standard_layout_v<RankSlot>);
static_assert(sizeof(RankSlot) == 128);
static_assert(offsetof(RankSlot, consumed) == 64);
static_assert(offsetof(RankSlot, owner) == 32);
static_assert(offsetof(RankSlot, agreement_left) == 40);
static_assert(offsetof(RankSlot, pid_namespace) == 48);

// A process identity that survives pid reuse: the pid plus the low 32 bits of its start time
// (clock ticks since boot, /proc/<pid>/stat field 22).
constexpr std::uint64_t owner_word(std::uint32_t pid, std::uint32_t start_ticks) {
  return (std::uint64_t{start_ticks} << 32) | pid;
}
constexpr std::uint32_t owner_pid(std::uint64_t word) { return static_cast<std::uint32_t>(word); }
constexpr std::uint32_t owner_start(std::uint64_t word) { return static_cast<std::uint32_t>(word >> 32); }

// Control block of one rank's completion ring (single producer: the daemon; single consumer:
// the engine). Records follow it.
struct alignas(64) CompletionRingControl {
  std::atomic<std::uint64_t> head;  // records written
  std::uint8_t pad0[56];
  std::atomic<std::uint64_t> tail;  // records consumed
  std::uint8_t pad1[56];
};
static_assert(sizeof(CompletionRingControl) == 128);

// Per-layer progress of layer-by-layer tasks, written by the rank, read by the engine. A task
// with ring sequence number `seq` uses slot seq % kProgressSlots. The rank writes task_id = 0,
// the counters, then the real task_id (release); a reader trusts the counters only if it reads
// the same task_id before and after them.
inline constexpr std::uint32_t kProgressSlots = 64;

struct alignas(64) LayerProgressSlot {
  std::atomic<std::uint64_t> task_id;
  std::atomic<std::uint32_t> layers_enqueued;  // layer copies queued and their event recorded
  std::atomic<std::uint32_t> layers_done;      // layer copies complete
  std::uint8_t pad[48];
};
static_assert(sizeof(LayerProgressSlot) == 64);

// Head of a rank's progress block; followed by kProgressSlots slots and then num_layers
// 64-byte interprocess event handles (cudaIpcEventHandle_t), one per layer.
// The handles belong to the daemon of `events_epoch`: one that restarts overwrites them, and an
// event whose exporter died must not be opened. The daemon stores events_published = 0, writes
// the handles (8-byte words) and events_epoch, then events_published = n (release); the engine
// trusts a copy only if events_published and events_epoch read the same before and after it and
// events_epoch is the rank's attached epoch.
struct alignas(64) ProgressControl {
  std::atomic<std::uint32_t> events_published;  // number of valid event handles (0: none, host backend)
  std::atomic<std::uint32_t> events_epoch;      // the attach epoch whose daemon exported them
  std::uint8_t pad[56];
};
static_assert(sizeof(ProgressControl) == 64);

// Agreement across ranks for storage tasks: rank r publishes its local count for the task with
// ring sequence number `seq` in its word at slot seq % kAgreementSlots as
// agreement_word(seq, value), then bumps `word`; every rank waits (futex, deadline) until each
// rank's word carries that seq and takes the MIN. A value of kAgreementAbort | status says the
// rank failed the task with that TaskStatus before agreeing, so the others stop waiting at once
// (and a cancellation reads as a cancellation on every rank). A rank writes a slot only after every
// live peer left the slot's previous task (RankSlot::agreement_left), so a slow peer holds the
// others back instead of being overtaken; a word whose seq is newer than the one waited for would
// mean the slot was reused before it was read: the task fails, it never guesses.
inline constexpr std::uint32_t kAgreementSlots = 1024;
inline constexpr std::uint32_t kAgreementAbort = 0xFFFF0000u;  // counts never reach it (kMaxKeysPerTask)

struct alignas(64) AgreementControl {
  std::atomic<std::uint32_t> word;     // futex: bumped after every publish
  std::atomic<std::uint32_t> waiters;
  std::uint8_t pad[56];
};
static_assert(sizeof(AgreementControl) == 64);

constexpr std::uint64_t agreement_word(std::uint64_t seq, std::uint32_t value) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(seq + 1)) << 32) | value;
}
constexpr std::uint32_t agreement_tag(std::uint64_t word) { return static_cast<std::uint32_t>(word >> 32); }
constexpr std::uint32_t agreement_value(std::uint64_t word) { return static_cast<std::uint32_t>(word); }

struct alignas(64) SessionHeader {
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t header_bytes;       // sizeof(SessionHeader) of the writer
  std::uint64_t generation;         // random per session
  std::uint32_t creator_pid;
  std::uint32_t creator_uid;
  std::atomic<std::uint32_t> state; // SessionState
  std::uint32_t completion_capacity;  // records per rank ring, power of two
  CacheGeometry geometry;
  std::uint64_t registry_offset;
  std::uint64_t registry_count;     // num_ranks * num_layers * kTensorKinds
  std::uint64_t task_ring_offset;
  std::uint64_t task_ring_bytes;    // power of two
  std::uint64_t completion_offset;  // first rank's CompletionRingControl
  std::uint64_t completion_stride;  // bytes per rank ring (control + records)
  std::uint64_t total_bytes;
  std::uint64_t progress_offset;    // first rank's ProgressControl
  std::uint64_t progress_stride;    // bytes per rank progress block
  std::atomic<std::uint32_t> cache_state;  // CacheState, written by the engine
  // 1: each rank's daemon takes over the host pool it kept when this suffix's previous session
  // died (its engine gone, not closed), if that pool has exactly this rank's shape; the blocks
  // written there stay loadable. 0: a new session starts with an empty host tier. The daemon,
  // not the engine, knows what it kept: a dead engine's segment may already be swept. Written
  // before publish.
  std::uint64_t take_over_host_tier;
  // The ranks this session serves, a bit mask; 0: every rank of the geometry. An engine that runs
  // one process per TP rank (sglang, vLLM) makes one session per process serving that rank only
  // (SessionOptions::only_rank): its daemon is rank r of geometry.num_ranks, so the storage tier
  // slices and names its objects as rank r of that many; a daemon of another rank is refused.
  // Written before publish.
  std::uint32_t served_ranks;
  // What the engine declares its KV to be (kv_identity.h): layout across ranks, element type,
  // pipeline stage and context-parallel slice; a daemon whose flags declare otherwise is refused.
  // All zero: nothing declared. Written before publish.
  KvIdentity kv_identity;

  alignas(64) std::atomic<std::int64_t> engine_heartbeat_ns;
  std::atomic<std::uint32_t> engine_pid;
  // The inode of the engine's pid namespace (/proc/self/ns/pid; 0 unknown), written before
  // publish: a pid the engine wrote (creator_pid, a /proc/<pid>/fd path) means that process only
  // to a daemon of the same namespace.
  std::uint64_t engine_pid_namespace;

  // Task ring producer side.
  alignas(64) std::atomic<std::uint64_t> ring_head;   // bytes published
  std::atomic<std::uint64_t> next_seq;                // seq of the next task
  std::atomic<std::uint32_t> publish_word;            // futex: bumped per publish
  std::atomic<std::uint32_t> consumer_waiters;
  // Producer waits here for ring space; consumers bump it after consuming.
  alignas(64) std::atomic<std::uint32_t> space_word;
  std::atomic<std::uint32_t> producer_waiters;
  // Engine waits here for completions; every rank bumps it after writing one.
  alignas(64) std::atomic<std::uint32_t> completion_word;
  std::atomic<std::uint32_t> completion_waiters;
  // Engine waits here for layer progress; ranks bump it after each layer.
  std::atomic<std::uint32_t> progress_word;
  std::atomic<std::uint32_t> progress_waiters;

  RankSlot ranks[kMaxRanks];
  // Cache groups (num_groups 0: the single-shape `geometry` describes the cache). Written by the
  // engine before publish, never changed after.
  CacheGroups groups;
};
static_assert(std::is_standard_layout_v<SessionHeader>);
static_assert(offsetof(SessionHeader, geometry) == 40);
static_assert(offsetof(SessionHeader, cache_state) == 208);
static_assert(offsetof(SessionHeader, take_over_host_tier) == 216);
static_assert(offsetof(SessionHeader, served_ranks) == 224);
static_assert(offsetof(SessionHeader, kv_identity) == 228);
static_assert(kMaxRanks <= 32, "served_ranks is a 32-bit mask");

// The ranks a session serves as a mask: SessionHeader::served_ranks, or every rank of the
// geometry when it is 0. `num_ranks` at most kMaxRanks.
constexpr std::uint32_t ranks_served(std::uint32_t served_ranks, std::uint32_t num_ranks) {
  return served_ranks != 0 ? served_ranks : (std::uint32_t{1} << num_ranks) - 1;
}
static_assert(offsetof(SessionHeader, engine_heartbeat_ns) == 256);
static_assert(offsetof(SessionHeader, ranks) % 64 == 0);
static_assert(offsetof(SessionHeader, groups) == 512 + kMaxRanks * sizeof(RankSlot));

constexpr std::size_t registry_index(const CacheGeometry& g, std::uint32_t rank, std::uint32_t layer,
                                     TensorKind k) {
  return (static_cast<std::size_t>(rank) * g.num_layers + layer) * kTensorKinds +
         static_cast<std::size_t>(k);
}

}  // namespace kvtd::proto
