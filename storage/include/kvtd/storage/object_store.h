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
// when it is of this model but another layout than `keep_fingerprint`, or when keep_name (given
// the object's name within its namespace) says no. Objects of a name kvtd did not make, and
// temporaries, are never touched.
struct GcRequest {
  std::vector<std::string> keep_models;
  std::uint64_t keep_fingerprint = 0;
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
  std::uint64_t failed = 0;   // removals that failed (named in last_error())
  std::uint64_t foreign = 0;  // named like objects but not written by kvtd: never removed
  bool complete = true;       // false: the deadline stopped the walk; run it again to go on
};

// Whether `request` keeps an object of `model`, layout `fingerprint_hex` (16 hex digits) and
// `name` within that namespace.
bool gc_keeps(const GcRequest& request, const std::string& own_model, const std::string& model,
              const std::string& fingerprint_hex, const std::string& name);

class ObjectStore {
 public:
  virtual ~ObjectStore() = default;
  // How many of `keys`, from the first, are stored (stops at the first hole).
  virtual Result<std::size_t, StorageErrc> exists(std::span<const std::string> keys) = 0;
  // Reads each key into its destination (object_bytes each). Per-key results.
  virtual Result<std::vector<ObjectResult>, StorageErrc> get(std::span<const std::string> keys,
                                                             std::span<std::byte* const> destinations) = 0;
  // Writes each key from its source (object_bytes each), replacing what was there. Per-key results.
  virtual Result<std::vector<ObjectResult>, StorageErrc> put(std::span<const std::string> keys,
                                                             std::span<const std::byte* const> sources) = 0;
  virtual Status<StorageErrc> remove(std::span<const std::string> keys) = 0;

  // Garbage collection: removes the stored objects `request` does not keep (see GcRequest),
  // walking the whole store (the file store's root; Redis: SCAN over every master, never
  // KEYS) until done or its deadline, and reports what it freed. Objects of this store's own
  // namespace leave its accounting (capacity, bytes stored) as they go.
  virtual Result<GcReport, StorageErrc> collect(const GcRequest& request) {
    (void)request;
    return make_error(StorageErrc::kInvalidArgument, "this store cannot collect garbage");
  }

  // Per-object hooks, so a caller can overlap its own work with the store's I/O. Hooks run on
  // the store's I/O threads, concurrently for different objects; the defaults below run them
  // around one whole-batch call.
  using ObjectHook = std::function<void(std::size_t index)>;
  // Like get(); then on_ok(i) once object i verified into destinations[i].
  virtual Result<std::vector<ObjectResult>, StorageErrc> get_each(std::span<const std::string> keys,
                                                                  std::span<std::byte* const> destinations,
                                                                  const ObjectHook& on_ok) {
    auto r = get(keys, destinations);
    if (r.ok() && on_ok)
      for (std::size_t i = 0; i < r->size(); ++i)
        if ((*r)[i] == ObjectResult::kOk) on_ok(i);
    return r;
  }
  // Whether get_lent works: the store reads each object into a buffer of its own (one per I/O
  // thread, reused, so it stays in cache) and lends it out once verified.
  virtual bool lends_payloads() const { return false; }
  // Reads and verifies each key; on_object(i, payload) is called with a verified object's
  // payload, valid only during that call, on the I/O thread that read it. Per-key results.
  using LentHook = std::function<void(std::size_t index, std::span<const std::byte> payload)>;
  virtual Result<std::vector<ObjectResult>, StorageErrc> get_lent(std::span<const std::string> keys,
                                                                  const LentHook& on_object) {
    (void)on_object;
    return make_error(StorageErrc::kInvalidArgument, "this store does not lend payloads (" +
                                                         std::to_string(keys.size()) + " objects)");
  }

  // Whether get_parts works: the store reads each object straight into the pieces of its
  // destination (a vectored read) and verifies it there, with no copy of its own.
  virtual bool reads_parts() const { return false; }
  // Reads each key into the consecutive pieces parts_of(i) gives (object_bytes in all) and
  // verifies it there, on the store's I/O threads; on_ok(i) once object i verified. A key whose
  // result is not kOk may have left any bytes in its pieces: the caller must not use them.
  using PartsOf = std::function<std::vector<std::span<std::byte>>(std::size_t index)>;
  virtual Result<std::vector<ObjectResult>, StorageErrc> get_parts(std::span<const std::string> keys,
                                                                   const PartsOf& parts_of, const ObjectHook& on_ok) {
    (void)parts_of;
    (void)on_ok;
    return make_error(StorageErrc::kInvalidArgument, "this store does not read into parts (" +
                                                         std::to_string(keys.size()) + " objects)");
  }

  // Whether put_parts writes scattered parts without gathering them first (the file store's
  // writev); when false, callers gather into their own staging and use put/put_each.
  virtual bool writes_parts() const { return false; }
  // Like put(), each object's payload given as consecutive parts (e.g. one block's K and V of
  // every layer, in place): the stored object is their concatenation. Only where writes_parts().
  using Parts = std::vector<std::span<const std::byte>>;
  virtual Result<std::vector<ObjectResult>, StorageErrc> put_parts(std::span<const std::string> keys,
                                                                   std::span<const Parts> objects) {
    (void)objects;
    return make_error(StorageErrc::kInvalidArgument, "this store cannot write scattered parts (" +
                                                         std::to_string(keys.size()) + " objects)");
  }
  // Like put(); before_put(i) fills sources[i] right before object i is written. When it returns
  // false the object is not written and its result is kFailed.
  using FillHook = std::function<bool(std::size_t index)>;
  virtual Result<std::vector<ObjectResult>, StorageErrc> put_each(std::span<const std::string> keys,
                                                                  std::span<const std::byte* const> sources,
                                                                  const FillHook& before_put) {
    std::vector<std::string> ok_keys;
    std::vector<const std::byte*> ok_sources;
    std::vector<std::size_t> where;
    for (std::size_t i = 0; i < keys.size(); ++i)
      if (!before_put || before_put(i)) {
        ok_keys.push_back(keys[i]);
        ok_sources.push_back(sources[i]);
        where.push_back(i);
      }
    auto r = put(ok_keys, ok_sources);
    if (!r.ok()) return r;
    std::vector<ObjectResult> out(keys.size(), ObjectResult::kFailed);
    for (std::size_t j = 0; j < where.size(); ++j) out[where[j]] = (*r)[j];
    return out;
  }
  virtual StoreStats stats() const = 0;
  // The most recent per-key failure, in words (e.g. "write ...: No space left on device",
  // "Connection refused"), or "" if none: the detail behind ObjectResult::kFailed.
  virtual std::string last_error() const = 0;
};

// Keys: 1..200 characters of [A-Za-z0-9_.:-] (block hashes, hex or base64url-ish).
bool valid_key(const std::string& key);

}  // namespace kvtd::storage
