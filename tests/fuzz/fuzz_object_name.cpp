// libFuzzer target: the stored-name and object-name parsers (kvtd/storage/object_name.h) on
// arbitrary text. Whatever parses must encode back to exactly the text parsed (the grammar has
// one spelling per name), with or without a key prefix (the first byte picks where to cut one).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "kvtd/storage/object_name.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvtd::storage;
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (auto n = StoredName::parse(text)) {
    if (n->encode() != text || !n->key_prefix.empty()) std::abort();
    if (StoredName::parse(n->encode()) != n) std::abort();
  }
  // A prefix: the last `cut` characters of the key part, when there are that many.
  const std::size_t cut = data[0] % 16 + 1;
  if (auto whole = StoredName::parse(text); whole && whole->key.size() > cut + 1) {
    const std::string prefix = whole->key.substr(whole->key.size() - cut);
    if (auto split = StoredName::parse(text, prefix)) {
      if (split->encode() != text || split->key_prefix != prefix) std::abort();
      if (split->key + "." + prefix != whole->key) std::abort();
    }
  }
  if (auto o = ObjectName::parse(text)) {
    if (o->encode() != text || ObjectName::parse(o->encode()) != o) std::abort();
  }
  return 0;
}
