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

// `raw` as a name of at most `max_len` (at least 32) characters: `raw` itself when it is one
// (valid_name); else the characters a name may hold (each other byte as '-'), cut to leave room,
// then "_h" and 16 hex digits of the 64-bit FNV-1a hash of every byte of `raw`, so two texts that
// differ only in what a name cannot hold never share a name. For names taken from what an
// engine's operator wrote (FastDeploy's version.yaml prefix, a model directory's name).
inline std::string name_of_text(std::string_view raw, std::size_t max_len) {
  if (valid_name(raw, max_len)) return std::string(raw);
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : raw) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  std::string out;
  for (char c : raw) {
    if (out.size() + 18 >= max_len) break;
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '-' || c == '.';
    out.push_back(ok ? c : '-');
  }
  out += "_h";
  static constexpr char kHex[] = "0123456789abcdef";
  for (int shift = 60; shift >= 0; shift -= 4) out.push_back(kHex[(h >> shift) & 0xF]);
  return out;
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
