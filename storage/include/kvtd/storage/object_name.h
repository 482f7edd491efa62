// kvtd/storage/object_name.h - the names objects are stored under: each a type with its encoder
// and parser side by side, and the grammar written here once.
//
//   object-name  = model "/" fingerprint "/" name
//   name         = a storage key; the daemon's are stored-names
//   stored-name  = key [ "." key-prefix ] ".w" config-version "-" task-version slice
//   slice        = ".r" rank | ".h" first-head
//
//   model          1-64 of [A-Za-z0-9_.-]              (proto::valid_model_id)
//   fingerprint    16 lowercase hex digits              (the cache layout's fingerprint)
//   key            the engine's key: 1-128 of [A-Za-z0-9_.:-] (the task codec checks), may hold dots
//   key-prefix     FastDeploy's RL key prefix (version.yaml), may hold dots
//   storage key    1-200 of [A-Za-z0-9_.:-], not "." or ".." (proto::valid_object_key)
//   *-version      decimal, no leading zero, 64 bits (a weight version)
//   rank           decimal, no leading zero, at most 4 digits (the rank's slice; 0 for a
//                  replicated cache)
//   first-head     decimal, no leading zero, at most 4 digits: the object holds the KV heads from
//                  this one on (--storage-object-heads; kvtd/proto/object_slices.h)
//
// The file store keeps an object at <root>/<model>/<fingerprint>/<2 hex fan-out>/<name>.kvo,
// Redis under "kvtd:" + object-name. Both parsers are exact inverses of the encoders: what parses
// encodes back to the same text.
//
// Values, copyable and movable; the functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvtd::storage {

// A rank's slice of one engine key, of one weight version.
struct StoredName {
  std::string key;         // the engine's key (with ".<key-prefix>" when parsed without one)
  std::string key_prefix;  // "" when none
  std::uint64_t config_weight_version = 0;  // --storage-weight-version
  std::uint64_t task_weight_version = 0;    // the task's weight version
  std::uint32_t rank = 0;     // the slice: the rank, or with by_head the first KV head
  bool by_head = false;       // ".h<first head>" instead of ".r<rank>"

  std::string encode() const;
  // The parts of `text`. With a non-empty `key_prefix`, the key must end in "." + key_prefix
  // (else nullopt) and it is split off; with an empty one, any prefix stays in `key`.
  static std::optional<StoredName> parse(std::string_view text, std::string_view key_prefix = {});
  bool operator==(const StoredName&) const = default;
};

// An object's name in the store: its namespace (model, layout) and its name within it.
struct ObjectName {
  std::string model;
  std::uint64_t fingerprint = 0;
  std::string name;  // a stored name, or any valid key a caller of the store chose

  std::string encode() const;
  static std::optional<ObjectName> parse(std::string_view text);
  bool operator==(const ObjectName&) const = default;
};

// "%016llx" of a fingerprint: the directory and key segment of a layout.
std::string fingerprint_hex(std::uint64_t fingerprint);

}  // namespace kvtd::storage
