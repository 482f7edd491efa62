#include "instance.h"

#include <charconv>
#include <fmt/format.h>

namespace kvtd::config {

namespace {

bool is_group_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

Error<ConfigErrc> bad_instance(const std::string& text, const std::string& why) {
  return make_error(ConfigErrc::kInvalidValue,
                    "--instance: '" + text + "' " + why + " (expected <rank> or <group>-<rank>, e.g. 3 or llama-3)");
}

}  // namespace

Result<InstanceName, ConfigErrc> parse_instance(const std::string& text) {
  const auto dash = text.rfind('-');
  const std::string rank_text = dash == std::string::npos ? text : text.substr(dash + 1);
  InstanceName out;
  if (rank_text.empty() || rank_text.size() > 4) return bad_instance(text, "has no rank of 1-4 digits after the last '-'");
  const auto* end = rank_text.data() + rank_text.size();
  const auto [ptr, ec] = std::from_chars(rank_text.data(), end, out.rank);
  if (ec != std::errc{} || ptr != end) return bad_instance(text, "does not end in a decimal rank");
  if (dash == std::string::npos) return out;
  out.group = text.substr(0, dash);
  if (out.group.empty() || out.group.size() > 64 || out.group.front() == '-')
    return bad_instance(text, "has a group name that is empty, longer than 64 or starts with '-'");
  for (char c : out.group)
    if (!is_group_char(c)) return bad_instance(text, "has a group name with a character outside [A-Za-z0-9_-]");
  return out;
}

std::string instance_config_path(const std::string& dir, const InstanceName& instance) {
  const std::string file = instance.group.empty() ? "kvtd.toml" : instance.group + ".toml";
  if (dir.empty() || dir.back() == '/') return dir + file;
  return dir + "/" + file;
}

std::string scan_flag_value(int argc, const char* const* argv, const std::string& name) {
  std::string value;
  const std::string with_equals = name + "=";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == name && i + 1 < argc) {
      value = argv[++i];
    } else if (arg.compare(0, with_equals.size(), with_equals) == 0) {
      value = arg.substr(with_equals.size());
    }
  }
  return value;
}

Result<std::string, ConfigErrc> instance_config_file(int argc, const char* const* argv) {
  const std::string dir = scan_flag_value(argc, argv, "--config-dir");
  if (dir.empty()) return std::string();
  auto instance = parse_instance(scan_flag_value(argc, argv, "--instance"));
  if (!instance)
    return make_error(ConfigErrc::kInvalidValue, "--config-dir needs --instance; " + instance.error().message);
  if (!scan_flag_value(argc, argv, "--config").empty())
    return make_error(ConfigErrc::kInvalidValue, "--config and --config-dir both name a config file: give one");
  return instance_config_path(dir, *instance);
}

Result<std::int64_t, ConfigErrc> resolve_device_id(const std::string& text, std::int64_t device_base,
                                                   std::int64_t rank) {
  if (device_base < 0 || device_base > kMaxDeviceId)
    return make_error(ConfigErrc::kInvalidValue,
                      fmt::format("--device-base: {} must be in [0, {}]", device_base, kMaxDeviceId));
  if (text == "auto") return device_base + rank;
  std::int64_t id = -1;
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, id);
  if (text.empty() || ec != std::errc{} || ptr != end)
    return make_error(ConfigErrc::kInvalidValue, "--device-id: '" + text + "' is neither a device ordinal nor auto");
  return id;
}

}  // namespace kvtd::config
