#include "kvtd/storage/object_format.h"

#include <xxhash.h>

#include <cstdio>

#include "kvtd/proto/names.h"

namespace kvtd::storage {

const char* object_result_name(ObjectResult r) {
  switch (r) {
    case ObjectResult::kOk: return "ok";
    case ObjectResult::kMissing: return "missing";
    case ObjectResult::kCorrupt: return "corrupt";
    case ObjectResult::kFailed: return "failed";
  }
  return "?";
}

bool valid_key(const std::string& key) { return proto::valid_object_key(key); }

std::uint64_t hash_bytes(const void* data, std::size_t bytes) { return XXH3_64bits(data, bytes); }

std::string namespaced_key(const StoreOptions& o, const std::string& key) {
  char fp[17];
  std::snprintf(fp, sizeof fp, "%016llx", static_cast<unsigned long long>(o.layout_fingerprint));
  return o.model_id + "/" + fp + "/" + key;
}

ObjectHeader make_header(const StoreOptions& o, const std::string& namespaced, std::span<const std::byte> payload) {
  ObjectHeader h{};
  h.magic = kObjectMagic;
  h.version = kObjectFormatVersion;
  h.layout_fingerprint = o.layout_fingerprint;
  h.key_hash = hash_bytes(namespaced.data(), namespaced.size());
  h.payload_bytes = payload.size();
  h.checksum = hash_bytes(payload.data(), payload.size());
  return h;
}

ObjectResult verify_object(const StoreOptions& o, const std::string& namespaced, const ObjectHeader& h,
                           std::span<const std::byte> payload) {
  if (h.magic != kObjectMagic || h.version != kObjectFormatVersion) return ObjectResult::kCorrupt;
  if (h.layout_fingerprint != o.layout_fingerprint) return ObjectResult::kCorrupt;
  if (h.key_hash != hash_bytes(namespaced.data(), namespaced.size())) return ObjectResult::kCorrupt;
  if (h.payload_bytes != o.object_bytes || payload.size() != o.object_bytes) return ObjectResult::kCorrupt;
  if (h.checksum != hash_bytes(payload.data(), payload.size())) return ObjectResult::kCorrupt;
  return ObjectResult::kOk;
}

}  // namespace kvtd::storage
