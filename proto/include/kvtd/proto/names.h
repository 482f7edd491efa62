// kvtd/proto/names.h - the one rule for names that end up in shared-memory object names, file
// paths and storage keys: a restricted character set, bounded length, never "." or "..".
//
// Pure functions, header-only, C++20.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace kvtd::proto {

// 1..max_len characters of [A-Za-z0-9_.-] (plus ':' if allow_colon), not "." or "..".
constexpr bool valid_name(std::string_view s, std::size_t max_len, bool allow_colon = false) {
  if (s.empty() || s.size() > max_len || s == "." || s == "..") return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '-' || c == '.' || (allow_colon && c == ':');
    if (!ok) return false;
  }
  return true;
}

// Session suffix (the engine's ipc_suffix): part of /dev/shm names.
constexpr bool valid_session_suffix(std::string_view s) { return valid_name(s, 64); }
// Model id: a directory name in the file store and part of every storage key.
constexpr bool valid_model_id(std::string_view s) { return valid_name(s, 64); }
// Storage object key (a block hash): a file name in the file store.
constexpr bool valid_object_key(std::string_view s) { return valid_name(s, 200, /*allow_colon=*/true); }

// The session object (ipc::session_object_name's `what`) of rank `rank`'s host pool of cache group
// `group`: "host<rank>" for group 0 (the one pool of a single-shape session, as ever), else
// "host<1000 + rank * 8 + group>" (ranks < 16, groups < 8): digits after "host", as the sweep of
// stale objects expects, and never a name of group 0.
inline std::string host_pool_object(std::uint32_t rank, std::uint32_t group) {
  return "host" + std::to_string(group == 0 ? rank : 1000 + rank * 8 + group);
}

// What every host pool object starts with, for readers other than the daemon that holds it:
// the sweep of dead sessions' objects (ipc::sweep_stale_objects) leaves a pool alone while the
// daemon named by `holder` lives, so a pool the daemon keeps after its engine died (to hand it
// to the engine's restart) survives other engines' sweeps. daemon::HostPool's header begins with
// exactly these fields (static_asserts there); `holder` is written after `magic` is complete.
struct HostPoolPrefix {
  std::uint64_t magic;  // kHostPoolMagic once the header is complete
  std::uint32_t version;
  std::uint32_t rank;
  std::uint64_t generation;
  std::uint64_t holder;  // owner_word (pid, start time) of the daemon that has it mapped or kept
};
inline constexpr std::uint64_t kHostPoolMagic = 0x4c4f4f5044545640ULL;  // "@VTDPOOL"
static_assert(std::is_standard_layout_v<HostPoolPrefix> && sizeof(HostPoolPrefix) == 32);

static_assert(valid_session_suffix("9923") && !valid_session_suffix("a/b") && !valid_session_suffix(".."));
static_assert(valid_object_key("abc:12") && !valid_model_id("abc:12"));

}  // namespace kvtd::proto
