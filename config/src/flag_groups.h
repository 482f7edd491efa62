// Flag groups declared and checked outside daemon_flags.cpp (which calls them in order).
#pragma once

#include "kvtd/config/daemon_config.h"

namespace CLI {
class App;
}

namespace kvtd::config {

void declare_kv_events_flags(CLI::App& app, DaemonConfig& c);
void declare_lifecycle_flags(CLI::App& app, DaemonConfig& c);
// After resolve_storage.
[[nodiscard]] Status<ConfigErrc> resolve_lifecycle(const DaemonConfig& c);
// After resolve_storage: the medium's default depends on the backend.
[[nodiscard]] Status<ConfigErrc> resolve_kv_events(DaemonConfig& c);

}  // namespace kvtd::config
