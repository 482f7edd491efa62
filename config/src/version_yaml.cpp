#include "kvtd/config/version_yaml.h"

#include <optional>
#include <regex>
#include <vector>

namespace kvtd::config {
namespace {

Error<ConfigErrc> bad(const std::string& why) { return make_error(ConfigErrc::kInvalidValue, why); }

bool blank(char c) { return c == ' ' || c == '\t'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && (blank(s.front()) || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (blank(s.back()) || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// A scalar as written, and whether it was quoted (a quoted one is always a string).
struct Scalar {
  std::string text;
  bool quoted = false;
};

// Reads a quoted scalar starting at s[0] (' or "); *rest is what follows its closing quote.
Result<Scalar, ConfigErrc> quoted(std::string_view s, std::string_view* rest) {
  const char q = s.front();
  Scalar out{"", true};
  std::size_t i = 1;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    if (q == '\'' && c == '\'') {
      if (i + 1 < s.size() && s[i + 1] == '\'') {  // '' is one quote inside single quotes
        out.text += '\'';
        ++i;
        continue;
      }
      break;
    }
    if (q == '"' && c == '"') break;
    if (q == '"' && c == '\\') {
      if (++i >= s.size()) return bad("an escape at the end of a double-quoted string");
      switch (s[i]) {
        case '"': case '\\': case '/': out.text += s[i]; break;
        case 't': out.text += '\t'; break;
        case 'n': out.text += '\n'; break;
        default: return bad(std::string("the escape \\") + s[i] + " in a double-quoted string");
      }
      continue;
    }
    out.text += c;
  }
  if (i >= s.size()) return bad("a quoted string is not closed on its line");
  *rest = s.substr(i + 1);
  return out;
}

// A plain scalar up to `stop` characters (", " in a flow mapping) or a comment (" #").
Scalar plain(std::string_view s, std::string_view stops, std::string_view* rest) {
  std::size_t i = 0;
  for (; i < s.size(); ++i) {
    if (s[i] == '#' && (i == 0 || blank(s[i - 1]))) break;
    if (stops.find(s[i]) != std::string_view::npos) break;
  }
  *rest = s.substr(i);
  return Scalar{std::string(trim(s.substr(0, i))), false};
}

Result<Scalar, ConfigErrc> scalar(std::string_view s, std::string_view stops, std::string_view* rest) {
  s = trim(s);
  if (!s.empty() && (s.front() == '"' || s.front() == '\'')) return quoted(s, rest);
  if (!s.empty() && std::string_view("&*!|>[{@`%").find(s.front()) != std::string_view::npos)
    return bad(std::string("a value starting with '") + s.front() + "' (anchors, tags, block or flow values)");
  return plain(s, stops, rest);
}

// Only a comment (or nothing) may follow a value.
bool only_comment(std::string_view rest) {
  rest = trim(rest);
  return rest.empty() || rest.front() == '#';
}

// What PyYAML's safe_load makes of a plain scalar that is not a string (YAML 1.1 resolvers).
std::optional<std::string> non_string_kind(const std::string& v) {
  static const std::regex kNull("^(~|null|Null|NULL)?$");
  static const std::regex kBool("^(yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$");
  static const std::regex kInt("^[-+]?(0b[01_]+|0[0-7_]+|(0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+|[1-9][0-9_]*(:[0-5]?[0-9])+)$");
  static const std::regex kFloat(
      "^([-+]?([0-9][0-9_]*)?\\.[0-9_]*([eE][-+][0-9]+)?|[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+\\.[0-9_]*|"
      "[-+]?\\.(inf|Inf|INF)|\\.(nan|NaN|NAN))$");
  static const std::regex kDate("^[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}([Tt ].*)?$");
  // Typed scalars are short; libstdc++'s regex recurses per character, so a long value is never
  // matched (it is a string in any case that matters here).
  if (v.size() > 128) return std::nullopt;
  if (std::regex_match(v, kNull)) return "null";
  if (std::regex_match(v, kBool)) return "a boolean";
  if (std::regex_match(v, kInt)) return "an integer";
  if (std::regex_match(v, kFloat)) return "a number";
  if (std::regex_match(v, kDate)) return "a date";
  return std::nullopt;
}

// The pairs of a flow mapping "{k: v, ...}" (all of `text` from its '{').
Status<ConfigErrc> flow_pairs(std::string_view s, std::vector<std::pair<Scalar, Scalar>>* out) {
  s.remove_prefix(1);
  for (;;) {
    s = trim(s);
    if (!s.empty() && s.front() == '}') break;
    std::string_view rest;
    auto key = scalar(s, ":,}", &rest);
    if (!key.ok()) return std::move(key).error();
    rest = trim(rest);
    if (rest.empty() || rest.front() != ':') return bad("a flow mapping entry without ':'");
    auto value = scalar(rest.substr(1), ",}", &rest);
    if (!value.ok()) return std::move(value).error();
    out->emplace_back(std::move(key).value(), std::move(value).value());
    rest = trim(rest);
    if (rest.empty()) return bad("a flow mapping that is not closed with '}'");
    if (rest.front() == ',') s = rest.substr(1);
    else s = rest;
  }
  if (!only_comment(trim(s).substr(1))) return bad("text after a flow mapping's '}'");
  return {};
}

}  // namespace

Result<std::string, ConfigErrc> version_from_yaml(std::string_view text) {
  if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);  // a UTF-8 byte-order mark
  std::vector<std::pair<Scalar, Scalar>> pairs;
  std::string flow;  // a flow mapping, gathered across its lines
  bool in_flow = false, seen_content = false;
  std::size_t line_no = 0;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    const std::string at = "line " + std::to_string(line_no) + ": ";
    if (in_flow) {
      flow += ' ';
      flow += line;
      if (flow.find('}') != std::string::npos) in_flow = false;
      continue;
    }
    const std::string_view t = trim(line);
    if (t.empty() || t.front() == '#') continue;
    if (t == "---" || t.rfind("--- ", 0) == 0 || t.rfind("%", 0) == 0) {
      if (seen_content && t.front() == '-') return bad(at + "a second YAML document");
      continue;
    }
    if (t == "...") break;
    if (blank(line.front())) {
      if (!seen_content) return bad(at + "indented text before any key");
      continue;  // nested under a key that is not `version`, or that key's continuation (checked below)
    }
    seen_content = true;
    if (t.front() == '{') {
      flow = std::string(t);
      in_flow = flow.find('}') == std::string::npos;
      continue;
    }
    std::string_view rest;
    auto key = scalar(t, ":", &rest);
    if (!key.ok()) return bad(at + key.error().message);
    if (rest.empty() || rest.front() != ':' || (rest.size() > 1 && !blank(rest[1])))
      return bad(at + "not a 'key: value' line of a mapping");
    std::string_view value_text = rest.substr(1);
    Scalar value;
    if (only_comment(value_text)) {
      value = Scalar{"", false};  // null, or a nested block (an error if it is the version)
      if (key->text == "version" && !text.empty() && blank(text.front()) && !trim(text.substr(0, text.find('\n'))).empty())
        return bad(at + "the version is a nested block or a multi-line value; it must be one string");
    } else {
      auto v = scalar(value_text, "", &rest);
      if (!v.ok()) return bad(at + v.error().message);
      if (!only_comment(rest)) return bad(at + "text after the value");
      value = std::move(v).value();
    }
    pairs.emplace_back(std::move(key).value(), std::move(value));
  }
  if (in_flow) return bad("a flow mapping that is not closed with '}'");
  if (!flow.empty()) {
    if (!pairs.empty()) return bad("a flow mapping beside block keys");
    KVTD_TRY(flow_pairs(flow, &pairs));
  }
  const Scalar* version = nullptr;
  for (const auto& [k, v] : pairs)
    if (k.text == "version") version = &v;  // a repeated key: the last wins, as in PyYAML
  if (version == nullptr) return bad("no top-level 'version' key");
  if (!version->quoted) {
    if (auto kind = non_string_kind(version->text))
      return bad("'version: " + version->text + "' is " + *kind + ", not a string (FastDeploy's reader fails on it too)");
  }
  return version->text;
}

std::string key_prefix_of_version(const std::string& version) {
  const auto first = version.find('-');
  const auto second = first == std::string::npos ? std::string::npos : version.find('-', first + 1);
  return version.substr(0, second);
}

}  // namespace kvtd::config
