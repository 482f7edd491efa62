// Flag groups declared and checked outside daemon_flags.cpp (which calls them in order).
#pragma once

#include "kvtd/config/daemon_config.h"

namespace CLI {
class App;
}

namespace kvtd::config {

struct RawFlags;  // raw_flags.h

void declare_storage_flags(CLI::App& app, RawFlags& f, DaemonConfig& c);
// After the session and FastDeploy's flags (the store's default path and key prefix come from
// FastDeploy's port and model path).
[[nodiscard]] Status<ConfigErrc> resolve_storage(const RawFlags& f, DaemonConfig& c);
void declare_identity_flags(CLI::App& app, RawFlags& f);
// After resolve_cache (a layout is refused beside cache groups).
[[nodiscard]] Status<ConfigErrc> resolve_identity(const RawFlags& f, DaemonConfig& c);
void declare_kv_events_flags(CLI::App& app, DaemonConfig& c);
void declare_lifecycle_flags(CLI::App& app, DaemonConfig& c);
// After resolve_storage.
[[nodiscard]] Status<ConfigErrc> resolve_lifecycle(const DaemonConfig& c);
// After resolve_storage: the medium's default depends on the backend.
[[nodiscard]] Status<ConfigErrc> resolve_kv_events(DaemonConfig& c);

// Before CLI11 reads it: the config file is a regular file of at most 1 MiB whose lines nest at
// most 8 levels (a FIFO would hang start-up, deep nesting costs gigabytes); the error names it.
[[nodiscard]] Status<ConfigErrc> check_config_file(const std::string& path);

}  // namespace kvtd::config
