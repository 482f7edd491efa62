// kvtd/storage/object_format.h - the header every stored object starts with.
//
//   [ObjectHeader][payload: object_bytes]
//
// checksum = XXH3-64 of the payload; key_hash = XXH3-64 of the namespaced key, so an object
// copied or renamed under another key (or another model's namespace) is detected as foreign.
// Fixed width, little-endian (the only byte order we build for).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>

#include "kvtd/storage/object_store.h"

namespace kvtd::storage {

inline constexpr std::uint32_t kObjectMagic = 0x4f445456;  // "VTDO"
inline constexpr std::uint16_t kObjectFormatVersion = 1;

struct ObjectHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint16_t reserved;
  std::uint64_t layout_fingerprint;
  std::uint64_t key_hash;
  std::uint64_t payload_bytes;
  std::uint64_t checksum;
};
static_assert(std::is_standard_layout_v<ObjectHeader>);
static_assert(sizeof(ObjectHeader) == 40);

// "<model_id>/<fingerprint hex>/<key>": the name under which an object is stored.
std::string namespaced_key(const StoreOptions& o, const std::string& key);

ObjectHeader make_header(const StoreOptions& o, const std::string& namespaced, std::span<const std::byte> payload);
// The same for a payload given as consecutive parts (hashed as one stream).
ObjectHeader make_header(const StoreOptions& o, const std::string& namespaced,
                         std::span<const std::span<const std::byte>> payload_parts);

// kOk if `header` and `payload` are a whole, uncorrupted object for this key; kCorrupt otherwise.
ObjectResult verify_object(const StoreOptions& o, const std::string& namespaced, const ObjectHeader& header,
                           std::span<const std::byte> payload);

// The checksum of a payload computed as its bytes arrive, in order (streaming XXH3 of the parts
// equals XXH3 of their concatenation). Thread-compatible; not copyable or movable.
class PayloadHasher {
 public:
  PayloadHasher();
  ~PayloadHasher();
  PayloadHasher(const PayloadHasher&) = delete;
  PayloadHasher& operator=(const PayloadHasher&) = delete;
  void update(std::span<const std::byte> bytes);
  std::uint64_t digest() const;
  std::uint64_t bytes() const { return bytes_; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  std::uint64_t bytes_ = 0;
};
// The header of an object of this key before its payload is known (no length, no checksum), and
// the same once `payload` has hashed all of it: a writer that hashes each stretch just before
// writing it seals the header last (make_header == seal_header(header_before_payload, hasher)).
ObjectHeader header_before_payload(const StoreOptions& o, const std::string& namespaced);
void seal_header(ObjectHeader& header, const PayloadHasher& payload);
// kOk if `header` is a whole object of this key whose payload, hashed as it was read, gave
// `payload` (its byte count and digest); kCorrupt otherwise.
ObjectResult verify_object(const StoreOptions& o, const std::string& namespaced, const ObjectHeader& header,
                           const PayloadHasher& payload);
// The same for a whole file image as read back (header, payload and anything after it): kOk only
// for exactly one whole object of this key. The O_DIRECT reader verifies what it read this way.
ObjectResult verify_object_image(const StoreOptions& o, const std::string& namespaced, std::span<const std::byte> image);

std::uint64_t hash_bytes(const void* data, std::size_t bytes);

// Whether `header` is one kvtd wrote under `namespaced` (format, version and the key's hash):
// storage gc removes nothing else, whatever its name looks like.
bool written_by_kvtd(const ObjectHeader& header, const std::string& namespaced);

}  // namespace kvtd::storage
