// Instance names of the systemd unit template kvtd@.service: "<rank>" for a host with one engine
// (config DIR/kvtd.toml, as before groups existed) or "<group>-<rank>" for a host with several
// engines or data-parallel groups (config DIR/<group>.toml). systemd cannot split an instance
// name, so kvtd does it: the unit passes --instance %i and --config-dir /etc/kvtd.
#pragma once

#include <cstdint>
#include <string>

#include "kvtd/proto/expected.h"
#include "kvtd/config/daemon_config.h"

namespace kvtd::config {

struct InstanceName {
  std::string group;  // empty for the single-group form "<rank>"
  std::int64_t rank = 0;
};

// "<rank>" or "<group>-<rank>": the rank is the decimal after the last '-'; a group is 1-64 of
// [A-Za-z0-9_-], not starting with '-'. Anything else is an error naming --instance.
[[nodiscard]] Result<InstanceName, ConfigErrc> parse_instance(const std::string& text);

// The config file of an instance under dir: dir/kvtd.toml or dir/<group>.toml.
std::string instance_config_path(const std::string& dir, const InstanceName& instance);

// The config file named by --config-dir and --instance on a command line (empty without
// --config-dir); an error if --config-dir comes without a valid --instance, or with --config.
[[nodiscard]] Result<std::string, ConfigErrc> instance_config_file(int argc, const char* const* argv);

// --device-id: a decimal ordinal, or "auto" = device_base + rank; range-checked by the caller.
[[nodiscard]] Result<std::int64_t, ConfigErrc> resolve_device_id(const std::string& text, std::int64_t device_base,
                                                                 std::int64_t rank);

// The value of the last "--name value" or "--name=value" on a command line; empty if absent.
// Read before CLI11 parses, because the config file to read depends on it.
std::string scan_flag_value(int argc, const char* const* argv, const std::string& name);

}  // namespace kvtd::config
