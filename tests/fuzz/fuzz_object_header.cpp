// libFuzzer target: a stored object (header + payload) as read back from a store. verify_object
// must accept only a whole object of this namespace with a matching checksum.
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
  if (verify_object(o, key, h, payload) == ObjectResult::kOk) {
    // Accepted: it must be exactly what make_header would write for these bytes.
    const ObjectHeader want = make_header(o, key, payload);
    if (payload.size() != o.object_bytes || std::memcmp(&want, &h, sizeof h) != 0) std::abort();
  }
  return 0;
}
