// Internal: what the file store needs beside its own logic (its I/O threads: io_pool.h):
// the private-root check at open, and telling abandoned temporaries from live ones.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kvtd/storage/file_system.h"
#include "kvtd/storage/object_name.h"
#include "kvtd/storage/object_store.h"

namespace kvtd::storage::detail {

// Creates the 256 fan-out directories under `dir` once, so puts never pay for a mkdir.
Status<StorageErrc> make_fanout(FileSystem& fs, const std::string& dir);

// An object file under a file store's root: <root>/<model>/<16 hex fingerprint>/<fan>/<name><suffix>.
// The parts of `path`, or nullopt for anything else (temporaries, stray files).
std::optional<ObjectName> parse_stored_path(const std::string& root, const std::string& path, const std::string& suffix);

// "<pid>p<pid namespace>-<thread>-<n>": a name no other writer of this process or another uses at
// once, naming the pid namespace its pid belongs to (abandoned_temporary).
std::string unique_suffix();

// The inode of this process's pid namespace (/proc/self/ns/pid), or 0.
std::uint64_t own_pid_namespace();

// A file store's garbage collection walk over `root` (see ObjectStore::collect): removes what
// `request` does not keep, calling forget(path) for each object gone (removed here or already
// gone); the first removal that failed is named in the report's first_failure.
Result<GcReport, StorageErrc> collect_files(FileSystem& fs, const std::string& root, const std::string& suffix,
                                            const std::string& own_model, const GcRequest& request,
                                            const std::function<void(const std::string& path)>& forget);

// CLOCK_MONOTONIC in nanoseconds (GcRequest's deadline).
std::int64_t monotonic_ns();

// The store root must be this user's alone (see check_private_root in file_store_support.cpp); a
// missing root is made 0700.
Status<StorageErrc> check_private_root(const std::string& root);
// Every directory above `root` (as named and as resolved) belongs to root or this user and is not
// writable by others unless sticky: no other user can swap the root (called by check_private_root).
Status<StorageErrc> check_ancestors(const std::string& root);

// ".tmp-<key>-<pid>[p<pid namespace>]-<thread>-<n>": whether the writer of this temporary can no
// longer rename it: the file is older than any write takes, or its writer, of this pid namespace,
// is gone (a writer of another namespace is judged by age alone).
bool abandoned_temporary(const std::string& base, std::int64_t mtime_ns);

}  // namespace kvtd::storage::detail
