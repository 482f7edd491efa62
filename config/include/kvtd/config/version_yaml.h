// kvtd/config/version_yaml.h - the `version` of FastDeploy's <model_path>/version.yaml, read as
// FastDeploy reads it (cache_transfer_manager.py get_key_prefix_from_version: PyYAML's
// safe_load(f)["version"], then the first two '-'-separated parts). Every file that reader
// accepts, kvtd accepts with the same answer: a byte-order mark, comments (whole-line and after
// a value), quoted keys and values with YAML's escapes (\xXX, \uXXXX: what json.dump and
// yaml.safe_dump write for non-ASCII text), a flow mapping ({version: ...}, JSON, across lines), a
// document marker, duplicate keys (the last wins, as in PyYAML), and other keys' values of any
// form (nested mappings and lists, flow or block, block scalars, anchors, tags), which are skipped.
// A value PyYAML does not read as a string (a number, a boolean, null, a date) makes FastDeploy's
// reader fail; kvtd refuses it naming it. A version that needs more (anchors, tags, a block or
// multi-line scalar, a collection) is refused with a message, never guessed.
#pragma once

#include <string>
#include <string_view>

#include "kvtd/config/daemon_config.h"

namespace kvtd::config {

// The `version` string of a version.yaml's text, or the problem in words.
Result<std::string, ConfigErrc> version_from_yaml(std::string_view text);

// FastDeploy's key prefix of a version: its first two '-'-separated parts ("RL-STEP12").
std::string key_prefix_of_version(const std::string& version);

}  // namespace kvtd::config
