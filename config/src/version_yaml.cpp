#include "kvtd/config/version_yaml.h"

#include <fmt/format.h>
#include <optional>
#include <vector>

namespace kvtd::config {
namespace {

Error<ConfigErrc> yaml_error(const std::string& why) { return make_error(ConfigErrc::kInvalidValue, why); }

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
  bool collection = false;  // a mapping, a list or a block scalar: skipped, never a version
};

// Scans `s` for flow collections' brackets from `*depth`, outside quoted scalars (a quote opens
// one where a scalar starts: after [ { , : or at the start) and before a comment. Returns the
// index just past the bracket that brought the depth back to 0 from above, or npos (then *depth
// is the depth at the end of `s`).
std::size_t scan_brackets(std::string_view s, int* depth) {
  char quote = 0;
  char last = ',';  // the previous non-blank character outside quotes
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (quote != 0) {
      if (quote == '"' && c == '\\') ++i;
      else if (quote == '\'' && c == '\'' && i + 1 < s.size() && s[i + 1] == '\'') ++i;  // '' is one quote
      else if (c == quote) quote = 0, last = c;
      continue;
    }
    if ((c == '"' || c == '\'') && std::string_view("[{,:").find(last) != std::string_view::npos) {
      quote = c;
    } else if (c == '#' && (i == 0 || blank(s[i - 1]))) {
      break;
    } else if (c == '[' || c == '{') {
      ++*depth;
    } else if (c == ']' || c == '}') {
      if (--*depth == 0) return i + 1;
    }
    if (!blank(c)) last = c;
  }
  return std::string_view::npos;
}

// `cp` as UTF-8. Each \u escape is one code point, a surrogate half included, as PyYAML reads JSON's
// "\ud83d\ude00" (two characters): the bytes only ever become a name through
// proto::name_of_text, which encodes what a name cannot hold.
void append_utf8(std::string* out, std::uint32_t cp) {
  auto byte = [&](std::uint32_t b) { out->push_back(static_cast<char>(b)); };
  if (cp < 0x80) {
    byte(cp);
  } else if (cp < 0x800) {
    byte(0xC0 | (cp >> 6));
    byte(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    byte(0xE0 | (cp >> 12));
    byte(0x80 | ((cp >> 6) & 0x3F));
    byte(0x80 | (cp & 0x3F));
  } else {
    byte(0xF0 | (cp >> 18));
    byte(0x80 | ((cp >> 12) & 0x3F));
    byte(0x80 | ((cp >> 6) & 0x3F));
    byte(0x80 | (cp & 0x3F));
  }
}

// The escape at s[*i] (just past the backslash) of a double-quoted scalar, YAML 1.1's set, which
// is what json.dump (\uXXXX for any non-ASCII character by default) and yaml.safe_dump (\xXX,
// \uXXXX) write; *i left on its last character.
Status<ConfigErrc> escape(std::string_view s, std::size_t* i, std::string* out) {
  const char e = s[*i];
  static constexpr std::string_view kFrom = "0abtnvfre \"/\\N_LP";
  static constexpr const char* kTo[] = {"\0", "\a", "\b", "\t", "\n", "\v", "\f", "\r", "\x1b", " ", "\"",
                                        "/",   "\\", "\xC2\x85", "\xC2\xA0", "\xE2\x80\xA8", "\xE2\x80\xA9"};
  if (const auto at = kFrom.find(e); at != std::string_view::npos) {
    if (e == '0') out->push_back('\0');
    else out->append(kTo[at]);
    return {};
  }
  const std::size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
  if (digits == 0) return yaml_error(std::string("the escape \\") + e + " in a double-quoted string");
  if (*i + digits >= s.size()) return yaml_error(fmt::format("a \\{} escape without its {} hex digits", e, digits));
  std::uint32_t cp = 0;
  for (std::size_t k = 1; k <= digits; ++k) {
    const char h = s[*i + k];
    const int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
    if (v < 0) return yaml_error(std::string("a \\") + e + " escape with a non-hex digit '" + h + "'");
    cp = cp << 4 | static_cast<std::uint32_t>(v);
  }
  if (cp > 0x10FFFF) return yaml_error("a \\U escape beyond Unicode");
  append_utf8(out, cp);
  *i += digits;
  return {};
}

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
      if (++i >= s.size()) return yaml_error("an escape at the end of a double-quoted string");
      KVTD_TRY(escape(s, &i, &out.text));
      continue;
    }
    out.text += c;
  }
  if (i >= s.size()) return yaml_error("a quoted string is not closed on its line");
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
    return yaml_error(std::string("a value starting with '") + s.front() + "' (anchors, tags, block or flow values)");
  return plain(s, stops, rest);
}

// Only a comment (or nothing) may follow a value.
bool only_comment(std::string_view rest) {
  rest = trim(rest);
  return rest.empty() || rest.front() == '#';
}

// A cursor over a plain scalar, for PyYAML's implicit resolvers (yaml/resolver.py, YAML 1.1),
// written out by hand: libstdc++'s std::regex recurses per character and trips GCC's
// -Wmaybe-uninitialized under the sanitizers.
struct Cursor {
  std::string_view s;
  std::size_t i = 0;
  bool end() const { return i == s.size(); }
  bool take(char c) {
    if (i < s.size() && s[i] == c) return ++i, true;
    return false;
  }
  bool take_any(std::string_view set) {
    if (i < s.size() && set.find(s[i]) != std::string_view::npos) return ++i, true;
    return false;
  }
  // At least `min` characters of `set`; how many were taken.
  std::size_t run(std::string_view set, std::size_t min = 0) {
    const std::size_t from = i;
    while (take_any(set)) {
    }
    if (i - from < min) i = from;
    return i - from;
  }
};

constexpr std::string_view kDigits = "0123456789", kDigitsUnderscore = "0123456789_";

bool is_sign_then(std::string_view v, std::size_t* at) {
  *at = (!v.empty() && (v[0] == '-' || v[0] == '+')) ? 1 : 0;
  return *at < v.size();
}

// (:[0-5]?[0-9])+ at the cursor.
bool sexagesimal_tail(Cursor& c) {
  bool any = false;
  while (c.take(':')) {
    c.take_any("012345");
    if (!c.take_any(kDigits)) return false;
    any = true;
  }
  return any;
}

bool yaml_int(std::string_view v) {
  std::size_t at = 0;
  if (!is_sign_then(v, &at)) return false;
  Cursor c{v, at};
  if (c.take('0')) {
    if (c.end()) return true;
    if (c.take('b')) return c.run("01_", 1) && c.end();
    if (c.take('x')) return c.run("0123456789abcdefABCDEF_", 1) && c.end();
    return c.run("01234567_", 1) && c.end();
  }
  if (!c.take_any("123456789")) return false;
  c.run(kDigitsUnderscore);
  return c.end() || (sexagesimal_tail(c) && c.end());
}

bool yaml_float(std::string_view v) {
  if (v == ".nan" || v == ".NaN" || v == ".NAN") return true;
  std::size_t at = 0;
  if (!is_sign_then(v, &at)) return false;
  const std::string_view rest = v.substr(at);
  if (rest == ".inf" || rest == ".Inf" || rest == ".INF") return true;
  auto exponent = [](Cursor& c) {
    if (!c.take_any("eE")) return true;
    return c.take_any("-+") && c.run(kDigits, 1) > 0;
  };
  Cursor c{v, at};
  if (c.take('.')) {  // .5, .5e+3 (PyYAML's resolver takes no sign here)
    return at == 0 && c.run(kDigitsUnderscore, 1) && exponent(c) && c.end();
  }
  if (!c.take_any(kDigits)) return false;
  c.run(kDigitsUnderscore);
  const std::size_t mark = c.i;
  if (sexagesimal_tail(c)) return c.take('.') && (c.run(kDigitsUnderscore), c.end());
  c.i = mark;
  return c.take('.') && (c.run(kDigitsUnderscore), exponent(c)) && c.end();
}

bool yaml_timestamp(std::string_view v) {
  Cursor c{v};
  if (c.run(kDigits) != 4 || !c.take('-')) return false;
  const std::size_t month = c.run(kDigits);
  if (month < 1 || month > 2 || !c.take('-')) return false;
  const std::size_t day = c.run(kDigits);
  if (day < 1 || day > 2) return false;
  if (c.end()) return month == 2 && day == 2;  // a date alone: YYYY-MM-DD exactly
  if (!c.take_any("Tt") && c.run(" \t", 1) == 0) return false;
  const std::size_t hour = c.run(kDigits);
  if (hour < 1 || hour > 2 || !c.take(':') || c.run(kDigits) != 2 || !c.take(':') || c.run(kDigits) != 2) return false;
  if (c.take('.')) c.run(kDigits);
  c.run(" \t");
  if (c.end() || c.take('Z')) return c.end();
  if (!c.take_any("-+")) return false;
  const std::size_t tz = c.run(kDigits);
  if (tz < 1 || tz > 2) return false;
  if (c.take(':') && c.run(kDigits) != 2) return false;
  return c.end();
}

// What PyYAML's safe_load makes of a plain scalar that is not a string, or nullopt for a string.
std::optional<std::string> non_string_kind(const std::string& v) {
  static const std::vector<std::string_view> kNull = {"", "~", "null", "Null", "NULL"};
  static const std::vector<std::string_view> kBool = {"yes", "Yes", "YES", "no",  "No",  "NO",    "true",  "True",  "TRUE",
                                                      "false", "False", "FALSE", "on", "On", "ON", "off", "Off", "OFF"};
  for (auto n : kNull)
    if (v == n) return "null";
  for (auto b : kBool)
    if (v == b) return "a boolean";
  if (yaml_int(v)) return "an integer";
  if (yaml_float(v)) return "a number";
  if (yaml_timestamp(v)) return "a date";
  return std::nullopt;
}

// The pairs of a flow mapping "{k: v, ...}" (all of `text` from its '{').
Status<ConfigErrc> flow_pairs(std::string_view s, std::vector<std::pair<Scalar, Scalar>>* out) {
  s.remove_prefix(1);
  for (;;) {
    s = trim(s);
    if (!s.empty() && s.front() == '}') break;
    std::string_view rest;
    KVTD_ASSIGN_OR_RETURN(Scalar key, scalar(s, ":,}", &rest));
    rest = trim(rest);
    if (rest.empty() || rest.front() != ':') return yaml_error("a flow mapping entry without ':'");
    const std::string_view after = trim(rest.substr(1));
    if (!after.empty() && (after.front() == '{' || after.front() == '[')) {  // a nested value: skipped
      int depth = 0;
      const std::size_t end = scan_brackets(after, &depth);
      if (end == std::string_view::npos) return yaml_error("a nested flow value that is not closed");
      out->emplace_back(std::move(key), Scalar{"", false, true});
      rest = after.substr(end);
    } else {
      KVTD_ASSIGN_OR_RETURN(Scalar value, scalar(after, ",}", &rest));
      out->emplace_back(std::move(key), std::move(value));
    }
    rest = trim(rest);
    if (rest.empty()) return yaml_error("a flow mapping that is not closed with '}'");
    if (rest.front() == ',') s = rest.substr(1);
    else s = rest;
  }
  if (!only_comment(trim(s).substr(1))) return yaml_error("text after a flow mapping's '}'");
  return {};
}

// What a value written as `v` (trimmed, not a plain or quoted scalar) is, for a message; "" when
// it is a scalar. Flow collections, block scalars, anchors, aliases and tags.
std::string_view not_a_scalar(std::string_view v) {
  switch (v.empty() ? ' ' : v.front()) {
    case '[': return "a flow list";
    case '{': return "a flow mapping";
    case '|': case '>': return "a block scalar";
    case '&': return "an anchored value";
    case '*': return "an alias";
    case '!': return "a tagged value";
    default: return "";
  }
}

// The value of a block mapping's key line (`value_text`, after its ':'; `next`, the line after it):
// a scalar; for a key other than the version also anything else, skipped (*skip_depth: the flow
// brackets it leaves open for the lines after; *sequence_may_follow: an empty value, whose block
// list may follow at column 0).
Result<Scalar, ConfigErrc> block_value(std::string_view value_text, bool is_version, std::string_view next,
                                       int* skip_depth, bool* sequence_may_follow) {
  *sequence_may_follow = false;
  if (only_comment(value_text)) {  // null, or a nested block or list (an error if it is the version)
    if (is_version && !trim(next).empty() && (blank(next.front()) || next.front() == '-'))
      return yaml_error("the version is a nested block, a list or a multi-line value; it must be one string");
    *sequence_may_follow = true;
    return Scalar{"", false};
  }
  const std::string_view v = trim(value_text);
  if (const std::string_view what = not_a_scalar(v); !what.empty()) {
    if (is_version) return yaml_error("the version is " + std::string(what) + "; it must be one plain or quoted string");
    if ((v.front() == '[' || v.front() == '{') && scan_brackets(v, skip_depth) != std::string_view::npos) *skip_depth = 0;
    return Scalar{"", false, true};  // another key's: skipped (a block scalar's lines are indented)
  }
  std::string_view rest;
  auto scalar_value = scalar(value_text, "", &rest);
  if (!scalar_value.ok()) {
    // Another key's quoted string continued on the lines below (yaml.safe_dump folds long ones at
    // 80 columns): its indented lines are skipped like any nested text.
    if (!is_version && (v.front() == '\'' || v.front() == '"')) return Scalar{"", false, true};
    return std::move(scalar_value).error();
  }
  if (!only_comment(rest)) return yaml_error("text after the value");
  // PyYAML folds an indented line after a plain scalar into it: the version would be longer than
  // this line says, and its prefix another. Refused, never cut short.
  if (is_version && !next.empty() && blank(next.front()) && !trim(next).empty() && trim(next).front() != '#')
    return yaml_error("the version continues on the next line (a multi-line value); it must be one line");
  return scalar_value;
}

}  // namespace

Result<std::string, ConfigErrc> version_from_yaml(std::string_view text) {
  if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);  // a UTF-8 byte-order mark
  std::vector<std::pair<Scalar, Scalar>> pairs;
  std::string flow;     // a top-level flow mapping (JSON), gathered across its lines
  int flow_depth = 0;   // its brackets still open
  int skip_depth = 0;   // brackets still open of another key's flow value spanning lines
  bool seen_content = false;
  bool sequence_may_follow = false;  // the last key's value was empty: its block list may follow at column 0
  std::size_t line_no = 0;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    const std::string at = fmt::format("line {}: ", line_no);
    if (flow_depth > 0) {
      flow += ' ';
      flow += line;
      if (scan_brackets(line, &flow_depth) != std::string_view::npos) flow_depth = 0;
      continue;
    }
    if (skip_depth > 0) {
      if (scan_brackets(line, &skip_depth) != std::string_view::npos) skip_depth = 0;
      continue;
    }
    const std::string_view t = trim(line);
    if (t.empty() || t.front() == '#') continue;
    if (t == "---" || t.rfind("--- ", 0) == 0 || t.rfind("%", 0) == 0) {
      if (seen_content && t.front() == '-') return yaml_error(at + "a second YAML document");
      continue;
    }
    if (t == "...") break;
    if (blank(line.front())) {
      if (!seen_content) return yaml_error(at + "indented text before any key");
      continue;  // nested under a key that is not `version`, or that key's continuation (checked below)
    }
    if (t.front() == '-' && (t.size() == 1 || blank(t[1]))) {  // a list item at column 0
      if (!sequence_may_follow) return yaml_error(at + "a list item where a key of the mapping belongs");
      continue;  // yaml.safe_dump writes a key's list at the key's own column
    }
    seen_content = true;
    if (t.front() == '{') {
      flow = std::string(t);
      if (scan_brackets(t, &flow_depth) != std::string_view::npos) flow_depth = 0;
      continue;
    }
    std::string_view rest;
    auto key = scalar(t, ":", &rest);
    if (!key.ok()) return yaml_error(at + key.error().message);
    if (rest.empty() || rest.front() != ':' || (rest.size() > 1 && !blank(rest[1])))
      return yaml_error(at + "not a 'key: value' line of a mapping");
    auto value = block_value(rest.substr(1), key->text == "version", text.substr(0, text.find('\n')), &skip_depth,
                             &sequence_may_follow);
    if (!value.ok()) return yaml_error(at + value.error().message);
    pairs.emplace_back(std::move(key).value(), std::move(value).value());
  }
  if (flow_depth > 0) return yaml_error("a flow mapping that is not closed with '}'");
  if (!flow.empty()) {
    if (!pairs.empty()) return yaml_error("a flow mapping beside block keys");
    KVTD_TRY(flow_pairs(flow, &pairs));
  }
  const Scalar* version = nullptr;
  for (const auto& [k, v] : pairs)
    if (k.text == "version") version = &v;  // a repeated key: the last wins, as in PyYAML
  if (version == nullptr) return yaml_error("no top-level 'version' key");
  if (version->collection) return yaml_error("the version is a mapping or a list; it must be one string");
  if (!version->quoted) {
    if (auto kind = non_string_kind(version->text))
      return yaml_error("'version: " + version->text + "' is " + *kind + ", not a string (FastDeploy's reader fails on it too)");
  }
  return version->text;
}

std::string key_prefix_of_version(const std::string& version) {
  const auto first = version.find('-');
  const auto second = first == std::string::npos ? std::string::npos : version.find('-', first + 1);
  return version.substr(0, second);
}

}  // namespace kvtd::config
