// The simple read and write shapes over ObjectStore::read/write.
#include "kvtd/storage/object_store.h"

#include <algorithm>
#include <fmt/format.h>

namespace kvtd::storage {

BatchResult read_to(ObjectStore& store, std::span<const std::string> keys, std::span<std::byte* const> destinations,
                    std::uint64_t object_bytes) {
  if (destinations.size() != keys.size())
    return make_error(StorageErrc::kInvalidArgument,
                      fmt::format("{} keys but {} destinations", keys.size(), destinations.size()));
  ReadInto into;
  into.pieces = [&](std::size_t i) { return Pieces{{destinations[i], object_bytes}}; };
  return store.read(keys, into);
}

BatchResult write_from(ObjectStore& store, std::span<const std::string> keys, std::span<const std::byte* const> sources,
                       std::uint64_t object_bytes) {
  if (sources.size() != keys.size())
    return make_error(StorageErrc::kInvalidArgument,
                      fmt::format("{} keys but {} sources", keys.size(), sources.size()));
  WriteFrom from;
  from.pieces = [&](std::size_t i) { return std::optional<ConstPieces>(ConstPieces{{sources[i], object_bytes}}); };
  return store.write(keys, from);
}

Result<std::vector<bool>, StorageErrc> presence(ObjectStore& store, std::span<const std::string> keys) {
  std::vector<bool> out(keys.size(), false);
  std::size_t at = 0;
  while (at < keys.size()) {
    KVTD_ASSIGN_OR_RETURN(const std::size_t found, store.exists(keys.subspan(at)));
    const std::size_t n = std::min(found, keys.size() - at);
    for (std::size_t i = 0; i < n; ++i) out[at + i] = true;
    at += n + 1;  // keys[at + n], if any, is the hole that ended the run
  }
  return out;
}

}  // namespace kvtd::storage
