// kvtd/proto/task.h - task and completion records carried by the shared-memory rings.
//
// A task record is a fixed header followed by its payload in the task ring itself:
// `num_src` int32 words, then `num_dst` int32 words, padded to kRecordAlign bytes.
//   Swap tasks: the words are source block ids, then destination block ids.
//   Storage tasks (kind >= kStorageQuery): the first `num_src` words are the storage section
//   (StorageTaskArgs, then `num_keys` uint16 key lengths, then the key characters, each part
//   padded to 4 bytes), the `num_dst` words are block ids (device, or host with
//   kTaskFlagHostBlocks), one per key (none for QUERY and CANCEL).
// A completion record has a fixed size.
//
// Standard layout, fixed width, no pointers: safe in shared memory and across processes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvtd::proto {

inline constexpr std::uint32_t kTaskFormatVersion = 1;
inline constexpr std::uint32_t kRecordAlign = 16;
inline constexpr std::size_t kMessageBytes = 168;

// TaskRecordHeader::flags bits.
inline constexpr std::uint16_t kTaskFlagLayerwise = 1u << 0;  // SWAP_TO_DEVICE layer by layer, with progress
inline constexpr std::uint16_t kTaskFlagHostBlocks = 1u << 1;  // storage task: block ids are host-pool blocks
// STORAGE_WRITE submitted with a SWAP_TO_HOST that carries keys: written or not by --write-policy.
inline constexpr std::uint16_t kTaskFlagPolicyBackup = 1u << 2;
// STORAGE_WRITE of host blocks the engine is evicting: written under write_back, else skipped.
inline constexpr std::uint16_t kTaskFlagEvictBackup = 1u << 3;
// CLEAR_CACHE: also mark every host-pool block invalid (the KV there belongs to the old weights).
inline constexpr std::uint16_t kTaskFlagDropHostTier = 1u << 4;
// Swap task: after the ids (the record padded to kRecordAlign) come one kEngineEventBytes
// interprocess event handle (cudaIpcEventHandle_t) per rank, in rank order: the event the rank's
// engine recorded on its stream after the GPU work this copy must follow. The daemon's copy
// waits for it on the GPU (cudaStreamWaitEvent), not on the host.
inline constexpr std::uint16_t kTaskFlagEngineEvent = 1u << 5;
// A swap and its write-through backup, tied by outcome. On a SWAP_TO_HOST: the next record is its
// backup, so the daemon keeps this swap's outcome for it. On that backup (a STORAGE_WRITE with
// kTaskFlagPolicyBackup and kTaskFlagHostBlocks whose after_task_id names the swap): stored only
// when the swap completed ok on this rank, else answered backup_skipped; the destination host
// blocks of a swap that did not happen hold other bytes, which must never be stored under its keys.
inline constexpr std::uint16_t kTaskFlagBackupPair = 1u << 6;
inline constexpr std::uint16_t kTaskFlagsKnown = 0x7F;
inline constexpr std::uint32_t kEngineEventBytes = 64;

// Storage keys: the engine's per-block keys (rolling prefix hashes), 1..kMaxKeyBytes of
// [A-Za-z0-9_.:-]. The daemon appends the weight versions and the rank before storing.
inline constexpr std::uint32_t kMaxKeyBytes = 128;
inline constexpr std::uint32_t kMaxKeysPerTask = 65536;

// A padding record (ring filler before a wrap) is kind 0 *and* this format_version; any other
// kind-0 record is a task with a reserved kind and gets an error completion, never skipped.
inline constexpr std::uint32_t kPaddingFormat = 0x50414444u;  // "PADD"

enum class TaskKind : std::uint16_t {
  kPadding = 0,  // reserved: ring filler (with kPaddingFormat); never submitted as a task
  kSwapToHost = 1,
  kSwapToDevice = 2,
  kStorageQuery = 3,     // keys -> leading hit count, MIN across ranks
  kStorageRead = 4,      // keys, blocks -> load the agreed prefix
  kStorageWrite = 5,     // keys, blocks -> write what is not stored yet (agreed)
  kPrefetch = 6,         // keys, host blocks, min_hits -> storage to host pool, or nothing
  kCancel = 7,           // target task id -> stop a prefetch or write between objects
  // Weight updates (submitted by EngineSession::clear_caches / restore_caches only; no words):
  kClearCache = 8,       // finish what is in flight, close every device mapping; later tasks fail
  kRestoreCache = 9,     // re-read the tensor registry, re-open, serve again
};
inline constexpr std::uint16_t kMaxTaskKind = 9;

constexpr bool is_cache_control_kind(TaskKind k) { return k == TaskKind::kClearCache || k == TaskKind::kRestoreCache; }

constexpr bool is_storage_kind(TaskKind k) {
  return k == TaskKind::kStorageQuery || k == TaskKind::kStorageRead || k == TaskKind::kStorageWrite ||
         k == TaskKind::kPrefetch || k == TaskKind::kCancel;
}

constexpr const char* task_kind_name(TaskKind k) {
  switch (k) {
    case TaskKind::kPadding: return "padding";
    case TaskKind::kSwapToHost: return "SWAP_TO_HOST";
    case TaskKind::kSwapToDevice: return "SWAP_TO_DEVICE";
    case TaskKind::kStorageQuery: return "STORAGE_QUERY";
    case TaskKind::kStorageRead: return "STORAGE_READ";
    case TaskKind::kStorageWrite: return "STORAGE_WRITE";
    case TaskKind::kPrefetch: return "PREFETCH";
    case TaskKind::kCancel: return "CANCEL";
    case TaskKind::kClearCache: return "CLEAR_CACHE";
    case TaskKind::kRestoreCache: return "RESTORE_CACHE";
  }
  return "unknown";
}

// Outcome of one task on one rank; also the merged outcome seen by the engine.
enum class TaskStatus : std::int32_t {
  kOk = 0,
  kUnknownKind = 1,
  kBadVersion = 2,
  kLengthMismatch = 3,
  kIdOutOfRange = 4,
  kDuplicateDestination = 5,
  kDeadlineExceeded = 6,
  kRankDead = 7,
  kRankNotAttached = 8,
  kDeviceError = 9,
  kMalformed = 10,
  kShuttingDown = 11,
  kInternal = 12,
  kHostTierLost = 13,   // a source host block holds no data written in this session (pool lost)
  kRankUnfenced = 14,   // rank silent and could not be stopped: it may still write its destinations
  kStorageUnavailable = 15,  // the storage backend could not be reached (message names the endpoint)
  kCancelled = 16,           // stopped by a CANCEL between objects; blocks_done says how far it got
  kStorageError = 17,        // the storage backend failed the write (ENOSPC, server error): nothing torn
  kAgreementFailed = 18,     // the ranks could not agree (an agreement slot was reused before it was read)
  kCacheCleared = 19,        // the rank released the engine's KV tensors for a weight update (until restore)
  kBackupSkipped = 20,       // a backup write not done: the store was behind (queue full or too old); nothing torn
  kEngineEventNotFired = 21,  // the swap's engine event never completed (engine died or stalled): nothing copied
  kIntegrity = 22,            // a swapped-in block's checksum differs from the one taken at swap-out: do not use it
};
inline constexpr TaskStatus kLastTaskStatus = TaskStatus::kIntegrity;

constexpr const char* task_status_name(TaskStatus s) {
  switch (s) {
    case TaskStatus::kOk: return "ok";
    case TaskStatus::kUnknownKind: return "unknown_kind";
    case TaskStatus::kBadVersion: return "bad_version";
    case TaskStatus::kLengthMismatch: return "length_mismatch";
    case TaskStatus::kIdOutOfRange: return "id_out_of_range";
    case TaskStatus::kDuplicateDestination: return "duplicate_destination";
    case TaskStatus::kDeadlineExceeded: return "deadline_exceeded";
    case TaskStatus::kRankDead: return "rank_dead";
    case TaskStatus::kRankNotAttached: return "rank_not_attached";
    case TaskStatus::kDeviceError: return "device_error";
    case TaskStatus::kMalformed: return "malformed";
    case TaskStatus::kShuttingDown: return "shutting_down";
    case TaskStatus::kInternal: return "internal";
    case TaskStatus::kHostTierLost: return "host_tier_lost";
    case TaskStatus::kRankUnfenced: return "rank_unfenced";
    case TaskStatus::kStorageUnavailable: return "storage_unavailable";
    case TaskStatus::kCancelled: return "cancelled";
    case TaskStatus::kStorageError: return "storage_error";
    case TaskStatus::kAgreementFailed: return "agreement_failed";
    case TaskStatus::kCacheCleared: return "cache_cleared";
    case TaskStatus::kBackupSkipped: return "backup_skipped";
    case TaskStatus::kEngineEventNotFired: return "engine_event_not_fired";
    case TaskStatus::kIntegrity: return "integrity";
  }
  return "unknown_status";
}

struct TaskRecordHeader {
  std::uint32_t record_bytes;    // header + payload + padding, multiple of kRecordAlign
  std::uint16_t kind;            // TaskKind (raw: an unknown value must survive decoding)
  std::uint16_t flags;           // kTaskFlag* bits
  std::uint32_t format_version;  // kTaskFormatVersion
  std::uint32_t num_src;
  std::uint32_t num_dst;
  std::uint32_t num_keys;        // storage tasks: keys in the storage section; else 0
  std::uint64_t task_id;         // chosen by the engine, unique per session
  std::uint64_t seq;             // ring sequence number, assigned by the producer
  std::uint64_t after_task_id;   // 0, or a task this one must run after
  std::int64_t deadline_ns;      // CLOCK_MONOTONIC; 0 = none
  std::int64_t submit_ns;        // CLOCK_MONOTONIC at submit
};
static_assert(std::is_standard_layout_v<TaskRecordHeader>);
static_assert(sizeof(TaskRecordHeader) == 64);
static_assert(offsetof(TaskRecordHeader, task_id) == 24);
static_assert(sizeof(TaskRecordHeader) % kRecordAlign == 0);

// First part of a storage task's storage section.
struct StorageTaskArgs {
  std::uint64_t weight_version;  // the engine's weight version: part of every stored key
  std::uint64_t cancel_task_id;  // CANCEL: the task to stop
  std::uint32_t min_hits;        // PREFETCH: fewer agreed hits than this and nothing is kept
  std::uint32_t key_bytes;       // total characters of every key
  std::uint64_t reserved;
};
static_assert(std::is_standard_layout_v<StorageTaskArgs>);
static_assert(sizeof(StorageTaskArgs) == 32);

// Words (4 bytes) of a storage section with `num_keys` keys of `key_bytes` characters in all.
constexpr std::uint64_t storage_section_words(std::uint64_t num_keys, std::uint64_t key_bytes) {
  return sizeof(StorageTaskArgs) / 4 + (2 * num_keys + 3) / 4 + (key_bytes + 3) / 4;
}

// Bytes of a record with these id counts, in 64 bits: counts read from shared memory may be
// anything, and a 32-bit result would wrap (2^29 + 2^29 ids is exactly 2^32 bytes).
// `events`: engine event handles after the ids (kTaskFlagEngineEvent), 0 without.
constexpr std::uint64_t task_record_bytes(std::uint32_t num_src, std::uint32_t num_dst, std::uint32_t events = 0) {
  const std::uint64_t raw = sizeof(TaskRecordHeader) + 4ull * (std::uint64_t{num_src} + num_dst);
  return (raw + kRecordAlign - 1) / kRecordAlign * kRecordAlign + std::uint64_t{kEngineEventBytes} * events;
}

struct CompletionRecord {
  std::uint64_t task_id;
  std::uint64_t seq;
  std::int32_t status;         // TaskStatus
  std::uint32_t rank;
  std::uint32_t kind;          // TaskKind as received
  std::uint32_t layers_done;
  std::uint64_t blocks_done;
  std::int64_t start_ns;       // CLOCK_MONOTONIC when execution began
  std::int64_t end_ns;         // CLOCK_MONOTONIC when the record was written
  std::uint64_t blocks_skipped;  // STORAGE_WRITE: keys not written (stored already, or not
                                 // selected by the write policy)
  char message[kMessageBytes]; // NUL-terminated; empty on success
};
static_assert(std::is_standard_layout_v<CompletionRecord>);
static_assert(sizeof(CompletionRecord) == 232);
static_assert(offsetof(CompletionRecord, message) == 64);

}  // namespace kvtd::proto
