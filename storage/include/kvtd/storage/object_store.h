// kvtd/storage/object_store.h - the storage tier: fixed-size objects (one block of one rank:
// every layer's K, V and scales) under string keys, in batches.
//
// Keys are namespaced by the model id and layout fingerprint given at open, so two models or two
// layouts never read each other's bytes. Every stored object carries a header (magic, format
// version, fingerprint, key hash, length, xxh3 checksum) that get() verifies: a corrupt,
// truncated or foreign object is reported as kCorrupt (a miss, counted), never handed back.
//
// Buffers are caller-owned (pinned staging chunks in the daemon): get() writes each object's
// payload straight into its destination, put() reads straight from its source.
//
// Thread-safety: every method may be called from several threads; each call is one batch.
// Ownership: stores are created by the factories below and owned by the caller.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvtd/proto/expected.h"

namespace kvtd::storage {

enum class StorageErrc {
  kInvalidArgument,  // bad key, buffer count, option (message names it)
  kUnavailable,      // the backend cannot be reached (server down) within the deadline
  kIo,               // a local I/O error that affects the whole call
  kProtocol,         // the server answered something unexpected
};

enum class ObjectResult : std::uint8_t {
  kOk,
  kMissing,  // not stored
  kCorrupt,  // stored but failed verification (bad checksum, truncated, foreign): a miss
  kFailed,   // this key's I/O failed (ENOSPC, EACCES, server error); existing objects intact
};
const char* object_result_name(ObjectResult r);

struct StoreOptions {
  std::string model_id;              // [A-Za-z0-9_.-]{1,64}
  std::uint64_t layout_fingerprint;  // of the cache geometry; part of every key
  std::uint64_t object_bytes;        // payload bytes of every object
};

struct StoreStats {
  std::uint64_t puts = 0, put_failures = 0;
  std::uint64_t gets = 0, hits = 0, misses = 0, corrupt = 0;
  std::uint64_t evictions = 0;
  std::uint64_t bytes_stored = 0;  // file backend: bytes on disk under its namespace
  std::uint64_t objects_stored = 0;  // file backend: objects under its namespace
  bool sized = false;                // bytes_stored and objects_stored are known (file backend)
};

// What a garbage collection keeps. An object is removed when its model is not in
// `keep_models` (only when that list is non-empty: other models are left alone otherwise),
// when it is of this model but a layout not in `keep_fingerprints` (one, or a session of cache
// groups' one per group: each group is a namespace of its own), or when keep_name (given
// the object's name within its namespace) says no. Objects of a name kvtd did not make, and
// temporaries, are never touched.
struct GcRequest {
  std::vector<std::string> keep_models;
  std::vector<std::uint64_t> keep_fingerprints;
  std::function<bool(const std::string& name)> keep_name;  // empty: every name of a kept namespace stays
  std::int64_t deadline_ns = 0;  // CLOCK_MONOTONIC; the walk stops there (0: no limit)
  bool dry_run = false;          // count what would go, remove nothing
  // Called for each object removed (not in a dry run), on the collecting thread.
  std::function<void(const std::string& model, const std::string& name)> on_removed;
};

struct GcReport {
  std::uint64_t examined = 0;  // objects looked at
  std::uint64_t removed = 0, removed_bytes = 0;  // objects (and their bytes) removed, or that would be
  std::uint64_t kept = 0;
  std::uint64_t failed = 0;   // removals that failed (the first named in first_failure)
  std::string first_failure;
  std::uint64_t foreign = 0;  // named like objects but not written by kvtd: never removed
  bool complete = true;       // false: the deadline stopped the walk; run it again to go on
};

struct ObjectName;
// Whether `request` keeps `object` (a store of `own_model` collecting).
bool gc_keeps(const GcRequest& request, const std::string& own_model, const ObjectName& object);

// One key's answer within a batch: its result and, when it failed, why in words (e.g. "write
// <path>: No space left on device", "Connection reset by peer"). Returned with the results, so the
// reason is the one of this key, never another worker's.
struct KeyResult {
  ObjectResult result = ObjectResult::kMissing;
  std::string error;  // kFailed: the cause; otherwise empty
  bool ok() const { return result == ObjectResult::kOk; }
  bool operator==(ObjectResult r) const { return result == r; }  // a key's answer is its result
};
using BatchResult = Result<std::vector<KeyResult>, StorageErrc>;

// What a store does without a copy of its own; each store declares it once.
struct StoreCapabilities {
  bool reads_in_place = false;  // reads straight into ReadInto pieces and verifies there (vectored read)
  bool writes_pieces = false;   // writes an object from scattered pieces without gathering them
};

using Pieces = std::vector<std::span<std::byte>>;
using ConstPieces = std::vector<std::span<const std::byte>>;

// Where a read puts each object. The store calls these on its I/O threads, concurrently for
// different objects.
struct ReadInto {
  // Object i's destination: consecutive pieces, object_bytes in all (a key whose pieces do not
  // add up fails, naming it). Required.
  std::function<Pieces(std::size_t index)> pieces;
  // Object i verified into its pieces (so a caller can move it on while later ones are read). May
  // be empty.
  std::function<void(std::size_t index)> on_verified;
  // The pieces may receive bytes before they are verified: a store that reads in place then
  // skips its own buffer, and a key whose result is not kOk leaves its pieces unspecified. When
  // false, the pieces receive an object's bytes only once verified.
  bool unverified_bytes_ok = false;
};

// Where a write takes each object.
struct WriteFrom {
  // Object i's payload as consecutive pieces (object_bytes in all), asked right before it is
  // written, on the I/O thread that writes it (so a caller can gather it into staging there).
  // nullopt: object i is not written and its result is kFailed with `refused` as the cause.
  std::function<std::optional<ConstPieces>(std::size_t index)> pieces;
  std::string refused = "its bytes could not be gathered";
};

class ObjectStore {
 public:
  virtual ~ObjectStore() = default;
  virtual StoreCapabilities capabilities() const = 0;
  // How many of `keys`, from the first, are stored (stops at the first hole).
  virtual Result<std::size_t, StorageErrc> exists(std::span<const std::string> keys) = 0;
  // Reads and verifies each key into where `into` says. Per-key results; a corrupt, truncated or
  // foreign object is kCorrupt and never lands as verified.
  virtual BatchResult read(std::span<const std::string> keys, const ReadInto& into) = 0;
  // Writes each key from what `from` gives, replacing what was there; each object is whole or
  // absent. Per-key results.
  virtual BatchResult write(std::span<const std::string> keys, const WriteFrom& from) = 0;
  virtual Status<StorageErrc> remove(std::span<const std::string> keys) = 0;

  // Garbage collection: removes the stored objects `request` does not keep (see GcRequest),
  // walking the whole store (the file store's root; Redis: SCAN over every master, never
  // KEYS) until done or its deadline, and reports what it freed. Objects of this store's own
  // namespace leave its accounting (capacity, bytes stored) as they go.
  virtual Result<GcReport, StorageErrc> collect(const GcRequest& request) = 0;
  virtual StoreStats stats() const = 0;
};

// The simple shapes, over read()/write(): each object whole in one buffer of object_bytes.
// read_to's destinations receive verified bytes only.
BatchResult read_to(ObjectStore& store, std::span<const std::string> keys, std::span<std::byte* const> destinations,
                    std::uint64_t object_bytes);
BatchResult write_from(ObjectStore& store, std::span<const std::string> keys,
                       std::span<const std::byte* const> sources, std::uint64_t object_bytes);

// Which of `keys` are stored, each on its own (holes included), over exists(): one call per run
// of stored keys and per hole, so a batch with few holes costs a call or two.
Result<std::vector<bool>, StorageErrc> presence(ObjectStore& store, std::span<const std::string> keys);

// Keys: 1..200 characters of [A-Za-z0-9_.:-] (block hashes, hex or base64url-ish).
bool valid_key(const std::string& key);

}  // namespace kvtd::storage
