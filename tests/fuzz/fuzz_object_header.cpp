// libFuzzer target: a stored object (header + payload) as read back from a store. verify_object
// must accept only a whole object of this namespace with a matching checksum, and the streamed
// variant (a load into a destination's pieces, hashed as it is read) and the image variant (the
// O_DIRECT reader's whole file) must give the same verdict.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "kvtd/storage/object_format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvtd::storage;
  if (size < sizeof(ObjectHeader)) return 0;
  const StoreOptions o{"model", 0x1234, 64};
  ObjectHeader h;
  std::memcpy(&h, data, sizeof h);
  std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data) + sizeof h, size - sizeof h);
  const std::string key = namespaced_key(o, "k0");
  const ObjectResult whole = verify_object(o, key, h, payload);
  // The reader that loads into a destination's pieces hashes the same bytes in stretches as they
  // are read: it must agree with the whole-buffer verdict wherever the payload is cut (first
  // byte of input picks).
  const std::size_t cut1 = payload.empty() ? 0 : data[0] % (payload.size() + 1);
  const std::size_t cut2 = cut1 + (payload.size() - cut1) / 2;
  PayloadHasher streamed;
  streamed.update(payload.subspan(0, cut1));
  streamed.update(payload.subspan(cut1, cut2 - cut1));
  streamed.update(payload.subspan(cut2));
  if (verify_object(o, key, h, streamed) != whole) std::abort();
  // The O_DIRECT reader verifies the whole file image it read (header, payload and whatever
  // followed): exactly one whole object, else corrupt.
  const std::span<const std::byte> image(reinterpret_cast<const std::byte*>(data), size);
  const ObjectResult want_image = size == sizeof h + o.object_bytes ? whole : ObjectResult::kCorrupt;
  if (verify_object_image(o, key, image) != want_image) std::abort();
  if (whole == ObjectResult::kOk) {
    // Accepted: it must be exactly what make_header would write for these bytes.
    const ObjectHeader want = make_header(o, key, payload);
    if (payload.size() != o.object_bytes || std::memcmp(&want, &h, sizeof h) != 0) std::abort();
  }
  return 0;
}
