#include "kvtd/storage/object_format.h"

#include <algorithm>
#include <cstring>

#include <xxhash.h>
#if defined(__x86_64__)
// Debian's libxxhash picks the widest vector unit at run time (SSE2, AVX2, AVX-512) in the
// *_dispatch entry points; the plain names run the build's baseline (SSE2). Same hash either way:
// the object format does not change.
#define XXH_DISPATCH_DISABLE_REPLACE 1
#include <xxh_x86dispatch.h>
#define KVTD_XXH3_64(p, n) XXH3_64bits_dispatch(p, n)
#define KVTD_XXH3_UPDATE(s, p, n) XXH3_64bits_update_dispatch(s, p, n)
#else
#define KVTD_XXH3_64(p, n) XXH3_64bits(p, n)
#define KVTD_XXH3_UPDATE(s, p, n) XXH3_64bits_update(s, p, n)
#endif

#include <cstdio>
#include <memory>
#include <new>

#include "kvtd/proto/names.h"
#include "kvtd/storage/object_name.h"

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

std::uint64_t hash_bytes(const void* data, std::size_t bytes) { return KVTD_XXH3_64(data, bytes); }

bool gc_keeps(const GcRequest& r, const std::string& own_model, const ObjectName& object) {
  const auto& kept = r.keep_models;
  if (!kept.empty() && std::find(kept.begin(), kept.end(), object.model) == kept.end())
    return false;  // a model the operator did not name
  if (object.model != own_model) return true;  // another model's layouts and names are its own business
  const auto& kept_layouts = r.keep_fingerprints;
  if (std::find(kept_layouts.begin(), kept_layouts.end(), object.fingerprint) == kept_layouts.end())
    return false;  // a layout this deployment no longer has
  return !r.keep_name || r.keep_name(object.name);
}

std::string namespaced_key(const StoreOptions& o, const std::string& key) {
  return ObjectName{o.model_id, o.layout_fingerprint, key}.encode();
}

ObjectHeader make_header(const StoreOptions& o, const std::string& namespaced, std::span<const std::byte> payload) {
  const std::span<const std::byte> one[1] = {payload};
  return make_header(o, namespaced, one);
}

ObjectHeader make_header(const StoreOptions& o, const std::string& namespaced,
                         std::span<const std::span<const std::byte>> parts) {
  ObjectHeader h = header_before_payload(o, namespaced);
  if (parts.size() == 1) {
    h.payload_bytes = parts[0].size();
    h.checksum = hash_bytes(parts[0].data(), parts[0].size());
    return h;
  }
  PayloadHasher hash;
  for (auto p : parts) hash.update(p);
  seal_header(h, hash);
  return h;
}

ObjectHeader header_before_payload(const StoreOptions& o, const std::string& namespaced) {
  ObjectHeader h{};
  h.magic = kObjectMagic;
  h.version = kObjectFormatVersion;
  h.layout_fingerprint = o.layout_fingerprint;
  h.key_hash = hash_bytes(namespaced.data(), namespaced.size());
  return h;
}

void seal_header(ObjectHeader& h, const PayloadHasher& payload) {
  h.payload_bytes = payload.bytes();
  h.checksum = payload.digest();
}

struct PayloadHasher::State {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> xxh3{XXH3_createState(), &XXH3_freeState};
};

PayloadHasher::PayloadHasher() : state_(std::make_unique<State>()) {
  if (!state_->xxh3) throw std::bad_alloc();
  XXH3_64bits_reset(state_->xxh3.get());
}

PayloadHasher::~PayloadHasher() = default;

void PayloadHasher::update(std::span<const std::byte> bytes) {
  KVTD_XXH3_UPDATE(state_->xxh3.get(), bytes.data(), bytes.size());
  bytes_ += bytes.size();
}

std::uint64_t PayloadHasher::digest() const { return XXH3_64bits_digest(state_->xxh3.get()); }

bool written_by_kvtd(const ObjectHeader& h, const std::string& namespaced) {
  return h.magic == kObjectMagic && h.version == kObjectFormatVersion && h.reserved == 0 &&
         h.key_hash == hash_bytes(namespaced.data(), namespaced.size());
}

namespace {

// Everything but the checksum: format, layout, key and size.
bool header_fits(const StoreOptions& o, const std::string& namespaced, const ObjectHeader& h, std::uint64_t bytes) {
  // reserved must be what this format writes (0): found by fuzz_object_header, an object with
  // other bits there was accepted although no writer of this version makes it.
  if (h.magic != kObjectMagic || h.version != kObjectFormatVersion || h.reserved != 0) return false;
  if (h.layout_fingerprint != o.layout_fingerprint) return false;
  if (h.key_hash != hash_bytes(namespaced.data(), namespaced.size())) return false;
  return h.payload_bytes == o.object_bytes && bytes == o.object_bytes;
}

}  // namespace

ObjectResult verify_object(const StoreOptions& o, const std::string& namespaced, const ObjectHeader& h,
                           const PayloadHasher& payload) {
  if (!header_fits(o, namespaced, h, payload.bytes())) return ObjectResult::kCorrupt;
  return payload.digest() == h.checksum ? ObjectResult::kOk : ObjectResult::kCorrupt;
}

ObjectResult verify_object(const StoreOptions& o, const std::string& namespaced, const ObjectHeader& h,
                           std::span<const std::byte> payload) {
  // reserved must be what this format writes (0): found by fuzz_object_header, an object with
  // other bits there was accepted although no writer of this version makes it.
  if (h.magic != kObjectMagic || h.version != kObjectFormatVersion || h.reserved != 0) return ObjectResult::kCorrupt;
  if (h.layout_fingerprint != o.layout_fingerprint) return ObjectResult::kCorrupt;
  if (h.key_hash != hash_bytes(namespaced.data(), namespaced.size())) return ObjectResult::kCorrupt;
  if (h.payload_bytes != o.object_bytes || payload.size() != o.object_bytes) return ObjectResult::kCorrupt;
  if (h.checksum != hash_bytes(payload.data(), payload.size())) return ObjectResult::kCorrupt;
  return ObjectResult::kOk;
}

ObjectResult verify_object_image(const StoreOptions& o, const std::string& namespaced, std::span<const std::byte> image) {
  if (image.size() != sizeof(ObjectHeader) + o.object_bytes) return ObjectResult::kCorrupt;  // truncated or trailing bytes
  ObjectHeader h;
  std::memcpy(&h, image.data(), sizeof h);  // the image need not be aligned for the header
  return verify_object(o, namespaced, h, image.subspan(sizeof h));
}

}  // namespace kvtd::storage
