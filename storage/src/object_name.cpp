// The encoders and parsers of kvtd/storage/object_name.h, side by side.
#include "kvtd/storage/object_name.h"

#include <cstdio>
#include <fmt/format.h>

#include "kvtd/proto/names.h"

namespace kvtd::storage {
namespace {

// A decimal of at most `max_digits`, no leading zero ("0" itself is fine), that fits 64 bits.
std::optional<std::uint64_t> parse_decimal(std::string_view s, std::size_t max_digits) {
  if (s.empty() || s.size() > max_digits || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (v > (UINT64_MAX - digit) / 10) return std::nullopt;
    v = v * 10 + digit;
  }
  return v;
}

constexpr std::size_t kMaxVersionDigits = 20;  // any 64-bit value
constexpr std::size_t kMaxRankDigits = 4;
}  // namespace

std::string StoredName::encode() const {
  std::string out = key;
  if (!key_prefix.empty()) out += "." + key_prefix;
  return fmt::format("{}.w{}-{}{}{}", out, config_weight_version, task_weight_version, by_head ? ".h" : ".r", rank);
}

std::optional<StoredName> StoredName::parse(std::string_view text, std::string_view key_prefix) {
  if (!proto::valid_object_key(text)) return std::nullopt;  // a store takes nothing else
  StoredName out;
  const auto r = text.rfind('.');
  if (r == std::string_view::npos || r + 1 >= text.size() || (text[r + 1] != 'r' && text[r + 1] != 'h'))
    return std::nullopt;
  const auto rank = parse_decimal(text.substr(r + 2), kMaxRankDigits);
  if (!rank) return std::nullopt;
  out.rank = static_cast<std::uint32_t>(*rank);
  out.by_head = text[r + 1] == 'h';
  text = text.substr(0, r);
  const auto w = text.rfind(".w");
  if (w == std::string_view::npos) return std::nullopt;
  const auto versions = text.substr(w + 2);
  const auto dash = versions.find('-');
  if (dash == std::string_view::npos) return std::nullopt;
  const auto config_wv = parse_decimal(versions.substr(0, dash), kMaxVersionDigits);
  const auto task_wv = parse_decimal(versions.substr(dash + 1), kMaxVersionDigits);
  if (!config_wv || !task_wv) return std::nullopt;
  out.config_weight_version = *config_wv;
  out.task_weight_version = *task_wv;
  text = text.substr(0, w);
  if (!key_prefix.empty()) {
    const std::string tail = "." + std::string(key_prefix);
    if (text.size() <= tail.size() || text.substr(text.size() - tail.size()) != tail) return std::nullopt;
    text = text.substr(0, text.size() - tail.size());
    out.key_prefix = key_prefix;
  }
  // The key part: an engine key, or one with its prefix joined when parsed without it (so only
  // the store's own bound, which the whole name met, applies).
  if (!proto::valid_object_key(text)) return std::nullopt;
  out.key = text;
  return out;
}

std::string fingerprint_hex(std::uint64_t fingerprint) {
  char fp[17];
  std::snprintf(fp, sizeof fp, "%016llx", static_cast<unsigned long long>(fingerprint));
  return fp;
}

std::string ObjectName::encode() const { return model + "/" + fingerprint_hex(fingerprint) + "/" + name; }

std::optional<ObjectName> ObjectName::parse(std::string_view text) {
  const auto a = text.find('/');
  if (a == std::string_view::npos) return std::nullopt;
  const auto b = text.find('/', a + 1);
  if (b == std::string_view::npos || b - a - 1 != 16) return std::nullopt;
  ObjectName out;
  out.model = text.substr(0, a);
  if (!proto::valid_model_id(out.model)) return std::nullopt;
  for (char c : text.substr(a + 1, 16)) {
    const bool hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
    if (!hex) return std::nullopt;
    out.fingerprint = out.fingerprint * 16 + static_cast<std::uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  }
  out.name = text.substr(b + 1);
  if (!proto::valid_object_key(out.name)) return std::nullopt;
  return out;
}

}  // namespace kvtd::storage
