// The builtin filters, tests, methods and global functions, as Jinja2 3.1 and Python 3 define
// them (transformers' tojson replaces Jinja2's). Each refuses what it does not implement with a
// message naming it, rather than computing something else.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>
#include <limits>

#include "chat/jinja_interpreter.h"
#include "chat/jinja_parser.h"
#include "core/status.h"
#include "core/utf8.h"

namespace e4kv::jinja {
namespace {

constexpr int64_t kMaxRange = 100000;  // Jinja2's sandbox MAX_RANGE

constexpr std::string_view kFilters[] = {
    "abs",    "attr",   "capitalize", "count",      "d",           "default", "dictsort",
    "e",      "escape", "first",      "float",      "forceescape", "indent",  "int",
    "items",  "join",   "last",       "length",     "list",        "lower",   "map",
    "max",    "min",    "reject",     "rejectattr", "replace",     "reverse", "round",
    "safe",   "select", "selectattr", "sort",       "string",      "sum",     "title",
    "tojson", "trim",   "unique",     "upper",      "wordcount"};

constexpr std::string_view kTests[] = {
    "boolean", "callable", "defined",  "divisibleby", "eq",       "equalto", "escaped",
    "even",    "false",    "filter",   "float",       "ge",       "gt",      "greaterthan",
    "in",      "integer",  "iterable", "le",          "lessthan", "lower",   "lt",
    "mapping", "ne",       "none",     "number",      "odd",      "sameas",  "sequence",
    "string",  "test",     "true",     "undefined",   "upper",    "==",      "!=",
    "<",       "<=",       ">",        ">="};

// A decoded code point with its bytes.
struct Char {
  char32_t cp;
  std::string_view bytes;
};

std::vector<Char> decode(std::string_view text) {
  std::vector<Char> chars;
  chars.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const Utf8Step step = utf8_step(text, pos);
    const char32_t cp = step.valid ? utf8_decode(text, pos, step.length) : 0xFFFD;
    chars.push_back({cp, text.substr(pos, step.length)});
    pos += step.length;
  }
  return chars;
}

bool is_ascii_alpha(char32_t cp) {
  return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z');
}
// Letters with case among the scripts chat text mostly uses (Latin, Greek, Cyrillic); their case
// is mapped only for ASCII.
bool is_cased(char32_t cp) {
  return is_ascii_alpha(cp) || (cp >= 0xC0 && cp <= 0x24F && cp != 0xD7 && cp != 0xF7) ||
         (cp >= 0x370 && cp <= 0x3FF) || (cp >= 0x400 && cp <= 0x4FF);
}
char32_t lower_cp(char32_t cp) {
  return cp >= 'A' && cp <= 'Z' ? cp + 32 : cp;
}
char32_t upper_cp(char32_t cp) {
  return cp >= 'a' && cp <= 'z' ? cp - 32 : cp;
}
void append_cp(std::string& out, const Char& c, char32_t mapped) {
  if (mapped == c.cp) {
    out.append(c.bytes);
  } else {
    append_utf8(out, mapped);
  }
}

// Python's str.capitalize(): the first character upper-cased, the rest lower-cased.
std::string capitalize(std::string_view text) {
  std::string out;
  const auto chars = decode(text);
  for (size_t i = 0; i < chars.size(); ++i) {
    append_cp(out, chars[i], i == 0 ? upper_cp(chars[i].cp) : lower_cp(chars[i].cp));
  }
  return out;
}

// Python's str.title(): a cased character after an uncased one is upper-cased, others lowered.
std::string python_title(std::string_view text) {
  std::string out;
  bool previous_cased = false;
  for (const Char& c : decode(text)) {
    append_cp(out, c, previous_cased ? lower_cp(c.cp) : upper_cp(c.cp));
    previous_cased = is_cased(c.cp);
  }
  return out;
}

// Jinja2's title filter: words start after '-', whitespace or an opening bracket; each word's
// first character upper-cased and the rest lower-cased.
std::string jinja_title(std::string_view text) {
  std::string out;
  bool word_start = true;
  for (const Char& c : decode(text)) {
    const bool separator = c.cp == '-' || c.cp == '(' || c.cp == '{' || c.cp == '[' ||
                           c.cp == '<' || is_python_space(c.cp);
    if (separator) {
      out.append(c.bytes);
      word_start = true;
    } else {
      append_cp(out, c, word_start ? upper_cp(c.cp) : lower_cp(c.cp));
      word_start = false;
    }
  }
  return out;
}

// Python's str.splitlines().
std::vector<std::string> split_lines(std::string_view text, bool keep_ends) {
  std::vector<std::string> lines;
  std::string line;
  const auto chars = decode(text);
  for (size_t i = 0; i < chars.size(); ++i) {
    const char32_t cp = chars[i].cp;
    const bool boundary = cp == '\n' || cp == '\r' || cp == 0x0B || cp == 0x0C ||
                          (cp >= 0x1C && cp <= 0x1E) || cp == 0x85 || cp == 0x2028 || cp == 0x2029;
    if (!boundary) {
      line.append(chars[i].bytes);
      continue;
    }
    std::string end(chars[i].bytes);
    if (cp == '\r' && i + 1 < chars.size() && chars[i + 1].cp == '\n') {
      end += '\n';
      ++i;
    }
    if (keep_ends) line += end;
    lines.push_back(std::move(line));
    line.clear();
  }
  if (!line.empty()) lines.push_back(std::move(line));
  return lines;
}

// Python's str.split(sep, maxsplit) and str.rsplit.
std::vector<std::string> split_text(std::string_view text, const std::string* sep, int64_t maxsplit,
                                    bool from_right, int line) {
  std::vector<std::string> parts;
  if (sep != nullptr) {
    if (sep->empty()) fail(line, "empty separator");
    if (!from_right) {
      size_t pos = 0;
      while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t hit = text.find(*sep, pos);
        if (hit == std::string_view::npos) break;
        parts.emplace_back(text.substr(pos, hit - pos));
        pos = hit + sep->size();
      }
      parts.emplace_back(text.substr(pos));
      return parts;
    }
    size_t end = text.size();
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      if (end < sep->size()) break;
      const size_t hit = text.rfind(*sep, end - sep->size());
      if (hit == std::string_view::npos) break;
      parts.emplace_back(text.substr(hit + sep->size(), end - hit - sep->size()));
      end = hit;
    }
    parts.emplace_back(text.substr(0, end));
    std::reverse(parts.begin(), parts.end());
    return parts;
  }
  // Runs of whitespace separate; none at the ends.
  const auto chars = decode(text);
  std::vector<std::pair<size_t, size_t>> words;  // [first, last) char indices
  for (size_t i = 0; i < chars.size();) {
    while (i < chars.size() && is_python_space(chars[i].cp)) ++i;
    if (i == chars.size()) break;
    size_t j = i;
    while (j < chars.size() && !is_python_space(chars[j].cp)) ++j;
    words.emplace_back(i, j);
    i = j;
  }
  auto join_chars = [&](size_t from, size_t to) {
    std::string s;
    for (size_t k = from; k < to; ++k) s.append(chars[k].bytes);
    return s;
  };
  if (maxsplit < 0 || static_cast<int64_t>(words.size()) <= maxsplit) {
    for (const auto& [a, b] : words) parts.push_back(join_chars(a, b));
    return parts;
  }
  const auto keep = static_cast<size_t>(maxsplit);
  if (!from_right) {
    for (size_t w = 0; w < keep; ++w) parts.push_back(join_chars(words[w].first, words[w].second));
    size_t rest = words[keep].first;
    parts.push_back(join_chars(rest, chars.size()));
    return parts;
  }
  const size_t first_kept = words.size() - keep;
  parts.push_back(join_chars(0, words[first_kept - 1].second));
  for (size_t w = first_kept; w < words.size(); ++w) {
    parts.push_back(join_chars(words[w].first, words[w].second));
  }
  return parts;
}

std::string html_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string replace_all(std::string_view text, std::string_view from, std::string_view to,
                        int64_t count) {
  std::string out;
  if (from.empty()) {
    // Python inserts `to` before every character and at the end.
    int64_t done = 0;
    for (const Char& c : decode(text)) {
      if (count < 0 || done < count) {
        out.append(to);
        ++done;
      }
      out.append(c.bytes);
    }
    if (count < 0 || done < count) out.append(to);
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t hit = text.find(from, pos);
    if (hit == std::string_view::npos) break;
    out.append(text.substr(pos, hit - pos));
    out.append(to);
    pos = hit + from.size();
    ++done;
  }
  out.append(text.substr(pos));
  return out;
}

const std::string& expect_string(const Value& value, std::string_view what, int line) {
  if (!value.is_string()) {
    fail(line, cat(what, " must be a string, got ", value.type_name()));
  }
  return value.as_string();
}

int64_t expect_int(const Value& value, std::string_view what, int line) {
  if (value.is_int()) return value.as_int();
  if (value.is_bool()) return value.as_bool() ? 1 : 0;
  fail(line, cat(what, " must be an integer, got ", value.type_name()));
}

bool arg_bool(const CallArgs& args, size_t index, std::string_view name, bool fallback) {
  const Value* v = args.get(index, name);
  return v == nullptr ? fallback : v->truthy();
}

// Jinja2's attribute getter for filters: "a.b.0" walks keys (and list indexes) one by one.
Value resolve_path(Interpreter& in, const Value& item, std::string_view path, int line) {
  Value current = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part(path.substr(start, dot == std::string_view::npos ? dot : dot - start));
    const bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c));
    });
    current = in.get_item(current, numeric ? Value::integer(std::stoll(part)) : Value::string(part),
                          line);
    if (dot == std::string_view::npos) return current;
    start = dot + 1;
  }
}

// The key a sort or unique filter compares: case folded unless case_sensitive.
Value sort_key(const Value& value, bool case_sensitive) {
  if (!case_sensitive && value.is_string()) return Value::string(ascii_lower(value.as_string()));
  return value;
}

Value string_list(std::vector<std::string> parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (std::string& part : parts) items.push_back(Value::string(std::move(part)));
  return Value::array(std::move(items));
}

// Python's str.format for the simple fields chat templates use: {}, {0}, {name}, {{ and }}.
std::string python_format(std::string_view format, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  bool automatic = false;
  bool manual = false;
  for (size_t i = 0; i < format.size(); ++i) {
    const char c = format[i];
    if (c == '}') {
      if (i + 1 < format.size() && format[i + 1] == '}') ++i;
      out += '}';
      continue;
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < format.size() && format[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    const size_t close = format.find('}', i);
    if (close == std::string_view::npos) fail(args.line, "str.format: single '{' in the format");
    const std::string field(format.substr(i + 1, close - i - 1));
    if (field.find_first_of(":!.[") != std::string::npos) {
      fail(args.line, cat("str.format: unsupported field '{", field,
                          "}' (conversions and format "
                          "specs are not supported)"));
    }
    const Value* value = nullptr;
    const bool numbered = !field.empty() && std::isdigit(static_cast<unsigned char>(field[0]));
    if (field.empty()) automatic = true;
    if (numbered) manual = true;
    if (automatic && manual) {
      fail(args.line,
           "str.format: cannot switch from manual field specification to automatic "
           "field numbering");
    }
    if (field.empty()) {
      value = auto_index < args.positional.size() ? &args.positional[auto_index] : nullptr;
      ++auto_index;
    } else if (std::all_of(field.begin(), field.end(),
                           [](char d) { return std::isdigit(static_cast<unsigned char>(d)); })) {
      const size_t index = std::stoul(field);
      value = index < args.positional.size() ? &args.positional[index] : nullptr;
    } else {
      value = args.keyword_arg(field);
    }
    if (value == nullptr) fail(args.line, cat("str.format: no argument for '{", field, "}'"));
    out += to_str(*value);
    i = close;
  }
  return out;
}

bool python_is_lower(std::string_view text) {
  bool cased = false;
  for (const Char& c : decode(text)) {
    if (c.cp >= 'A' && c.cp <= 'Z') return false;
    if (c.cp >= 'a' && c.cp <= 'z') cased = true;
  }
  return cased;
}

bool python_is_upper(std::string_view text) {
  bool cased = false;
  for (const Char& c : decode(text)) {
    if (c.cp >= 'a' && c.cp <= 'z') return false;
    if (c.cp >= 'A' && c.cp <= 'Z') cased = true;
  }
  return cased;
}

// Python's int(str) as Jinja2's int filter tries it: optional sign, digits, underscores between
// digits, surrounding whitespace.
std::optional<int64_t> parse_int(std::string_view text, int base) {
  const std::string trimmed = strip_text(text, nullptr, true, true);
  std::string digits;
  for (char c : trimmed) {
    if (c != '_') digits += c;
  }
  if (digits.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(digits.c_str(), &end, base);
  if (errno != 0 || end != digits.c_str() + digits.size()) return std::nullopt;
  return static_cast<int64_t>(v);
}

std::optional<double> parse_float(std::string_view text) {
  const std::string trimmed = strip_text(text, nullptr, true, true);
  if (trimmed.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(trimmed.c_str(), &end);
  if (end != trimmed.c_str() + trimmed.size()) return std::nullopt;
  return v;
}

}  // namespace

bool is_known_filter(std::string_view name) {
  return std::find(std::begin(kFilters), std::end(kFilters), name) != std::end(kFilters);
}

bool is_known_test(std::string_view name) {
  return std::find(std::begin(kTests), std::end(kTests), name) != std::end(kTests);
}

std::string ascii_lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string ascii_upper(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string strip_text(std::string_view text, const std::string* chars, bool left, bool right) {
  const auto all = decode(text);
  std::vector<char32_t> set;
  if (chars != nullptr) {
    for (const Char& c : decode(*chars)) set.push_back(c.cp);
  }
  auto strippable = [&](char32_t cp) {
    return chars == nullptr ? is_python_space(cp)
                            : std::find(set.begin(), set.end(), cp) != set.end();
  };
  size_t first = 0;
  size_t last = all.size();
  if (left) {
    while (first < last && strippable(all[first].cp)) ++first;
  }
  if (right) {
    while (last > first && strippable(all[last - 1].cp)) --last;
  }
  std::string out;
  for (size_t i = first; i < last; ++i) out.append(all[i].bytes);
  return out;
}

std::vector<Value> iterate(const Value& value, int line) {
  switch (value.kind()) {
    case Value::Kind::array:
      return value.as_array().items;
    case Value::Kind::object: {
      std::vector<Value> keys;
      const bool untrusted = value.as_object().untrusted_keys;
      for (const auto& [k, v] : value.as_object().entries) {
        keys.push_back(untrusted ? Value::untrusted_string(k) : Value::string(k));
      }
      return keys;
    }
    case Value::Kind::string: {
      std::vector<Value> chars;
      const std::string& text = value.as_string();
      for (std::string_view c : utf8_chars(text)) {
        const size_t begin = static_cast<size_t>(c.data() - text.data());
        chars.push_back(Value::string(
            std::string(c), slice_ranges(value.untrusted_ranges(), begin, begin + c.size())));
      }
      return chars;
    }
    case Value::Kind::undefined:  // Jinja2's default Undefined iterates as empty
      return {};
    default:
      fail(line, cat("'", value.type_name(), "' object is not iterable"));
  }
}

// `text` stripped as strip_text strips it, keeping the untrusted ranges of what is left.
Value strip_tracked(const TrackedText& text, const std::string* chars, bool left, bool right) {
  std::string kept = strip_text(text.text, chars, left, right);
  const size_t begin =
      left ? text.text.size() - strip_text(text.text, chars, true, false).size() : 0;
  ByteRanges untrusted = slice_ranges(text.untrusted, begin, begin + kept.size());
  return Value::string(std::move(kept), std::move(untrusted));
}

// ---- Attributes, items and methods --------------------------------------------------------------

namespace {

constexpr std::string_view kDictMethods[] = {"clear",      "copy",   "fromkeys", "get",
                                             "items",      "keys",   "pop",      "popitem",
                                             "setdefault", "update", "values"};
constexpr std::string_view kListMethods[] = {"append", "clear",   "copy",   "count",
                                             "extend", "index",   "insert", "pop",
                                             "remove", "reverse", "sort"};
constexpr std::string_view kStringMethods[] = {
    "capitalize",   "casefold",    "center",    "count",      "encode",       "endswith",
    "expandtabs",   "find",        "format",    "format_map", "index",        "isalnum",
    "isalpha",      "isascii",     "isdecimal", "isdigit",    "isidentifier", "islower",
    "isnumeric",    "isprintable", "isspace",   "istitle",    "isupper",      "join",
    "ljust",        "lower",       "lstrip",    "maketrans",  "partition",    "removeprefix",
    "removesuffix", "replace",     "rfind",     "rindex",     "rjust",        "rpartition",
    "rsplit",       "rstrip",      "split",     "splitlines", "startswith",   "strip",
    "swapcase",     "title",       "translate", "upper",      "zfill"};

template <size_t N>
bool contains(const std::string_view (&names)[N], std::string_view name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

// Methods whose result keeps track of its untrusted ranges itself: those that return the
// receiver, parts of it or an argument unchanged, or a bool or a number.
constexpr std::string_view kTrackedMethods[] = {
    "get",        "values",   "copy",    "count",   "index",        "strip",
    "lstrip",     "rstrip",   "join",    "find",    "rfind",        "rindex",
    "startswith", "endswith", "isdigit", "isalpha", "isdecimal",    "isnumeric",
    "isalnum",    "isspace",  "islower", "isupper", "removeprefix", "removesuffix"};

Value bound_method(const Value& receiver, const std::string& name) {
  return Value::callable(name, [receiver, name](Interpreter& in, const CallArgs& args) {
    const bool inputs_untrusted = holds_untrusted(receiver) || args_hold_untrusted(args);
    return track_builtin_result(in.call_method(receiver, name, args), inputs_untrusted,
                                contains(kTrackedMethods, name));
  });
}

Value loop_attribute(const LoopData& loop, const std::string& name) {
  const auto& items = *loop.items;
  const auto n = static_cast<int64_t>(items.size());
  const auto i = static_cast<int64_t>(loop.index0);
  if (name == "index") return Value::integer(i + 1);
  if (name == "index0") return Value::integer(i);
  if (name == "revindex") return Value::integer(n - i);
  if (name == "revindex0") return Value::integer(n - i - 1);
  if (name == "first") return Value::boolean(i == 0);
  if (name == "last") return Value::boolean(i == n - 1);
  if (name == "length") return Value::integer(n);
  if (name == "depth") return Value::integer(1);
  if (name == "depth0") return Value::integer(0);
  if (name == "previtem") return i > 0 ? items[loop.index0 - 1] : Value::undefined("loop.previtem");
  if (name == "nextitem") {
    return i + 1 < n ? items[loop.index0 + 1] : Value::undefined("loop.nextitem");
  }
  if (name == "cycle") {
    const size_t index0 = loop.index0;
    return Value::callable("loop.cycle", [index0](Interpreter&, const CallArgs& args) {
      if (args.positional.empty()) fail(args.line, "loop.cycle() needs at least one argument");
      return args.positional[index0 % args.positional.size()];
    });
  }
  return Value::undefined("loop." + name);
}

}  // namespace

Value Interpreter::get_attribute(const Value& object, const std::string& name, int /*line*/) {
  switch (object.kind()) {
    case Value::Kind::object:
      if (contains(kDictMethods, name)) return bound_method(object, name);
      if (const Value* v = object.as_object().find(name)) return *v;
      return Value::undefined(name);
    case Value::Kind::ns:
      if (const Value* v = object.namespace_data().find(name)) return *v;
      return Value::undefined(name);
    case Value::Kind::string:
      if (contains(kStringMethods, name)) return bound_method(object, name);
      return Value::undefined(name);
    case Value::Kind::array:
      if (contains(kListMethods, name)) return bound_method(object, name);
      return Value::undefined(name);
    case Value::Kind::loop:
      return loop_attribute(object.as_loop(), name);
    case Value::Kind::undefined: {
      const std::string& base = object.undefined_name();
      return Value::undefined(base.empty() ? name : base + "." + name);
    }
    default:
      return Value::undefined(name);
  }
}

Value Interpreter::get_item(const Value& object, const Value& key, int line) {
  if (key.is_string()) {
    if (object.is_object()) {
      if (const Value* v = object.as_object().find(key.as_string())) return *v;
    }
    if (object.is_array() || object.is_string()) return Value::undefined(key.as_string());
    return get_attribute(object, key.as_string(), line);
  }
  if ((key.is_int() || key.is_bool()) && (object.is_array() || object.is_string())) {
    int64_t index = key.is_int() ? key.as_int() : (key.as_bool() ? 1 : 0);
    if (object.is_array()) {
      const auto& items = object.as_array().items;
      const auto n = static_cast<int64_t>(items.size());
      if (index < 0) index += n;
      if (index < 0 || index >= n) return Value::undefined();
      return items[static_cast<size_t>(index)];
    }
    const auto chars = utf8_chars(object.as_string());
    const auto n = static_cast<int64_t>(chars.size());
    if (index < 0) index += n;
    if (index < 0 || index >= n) return Value::undefined();
    const std::string_view c = chars[static_cast<size_t>(index)];
    const size_t begin = static_cast<size_t>(c.data() - object.as_string().data());
    return Value::string(std::string(c),
                         slice_ranges(object.untrusted_ranges(), begin, begin + c.size()));
  }
  if (object.is_undefined()) return Value::undefined(object.undefined_name());
  return Value::undefined();
}

Value Interpreter::call_method(const Value& receiver, const std::string& name,
                               const CallArgs& args) {
  const int line = args.line;
  if (receiver.is_object()) {
    const ObjectData& dict = receiver.as_object();
    if (name == "get") {
      args.expect("dict.get", 2, {});
      if (args.positional.empty()) fail(line, "dict.get() takes at least 1 argument");
      const Value& key = args.positional[0];
      const Value* v = key.is_string() ? dict.find(key.as_string()) : nullptr;
      if (v != nullptr) return *v;
      return args.positional.size() > 1 ? args.positional[1] : Value::none();
    }
    if (name == "items" || name == "keys" || name == "values") {
      args.expect(cat("dict.", name), 0, {});
      std::vector<Value> out;
      for (const auto& [k, v] : dict.entries) {
        if (name == "items") {
          out.push_back(Value::array({Value::string(k), v}, /*is_tuple=*/true));
        } else {
          out.push_back(name == "keys" ? Value::string(k) : v);
        }
      }
      return Value::array(std::move(out));
    }
    if (name == "copy") return receiver;
    fail(line, cat("unsupported method 'dict.", name,
                   "' (transformers renders in an immutable "
                   "sandbox: a template may not modify a dict)"));
  }
  if (receiver.is_array()) {
    const auto& items = receiver.as_array().items;
    if (name == "count" || name == "index") {
      args.expect(cat("list.", name), 1, {});
      if (args.positional.empty()) fail(line, cat("list.", name, "() takes exactly one argument"));
      int64_t count = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        if (!values_equal(items[i], args.positional[0])) continue;
        if (name == "index") return Value::integer(static_cast<int64_t>(i));
        ++count;
      }
      if (name == "index") fail(line, cat(to_repr(args.positional[0]), " is not in list"));
      return Value::integer(count);
    }
    if (name == "copy") return receiver;
    fail(line, cat("unsupported method 'list.", name,
                   "' (transformers renders in an immutable "
                   "sandbox: a template may not modify a list)"));
  }
  if (!receiver.is_string())
    fail(line, cat("unsupported method '", receiver.type_name(), ".", name, "'"));
  const std::string& text = receiver.as_string();
  auto optional_string = [&](size_t index, std::string_view key) -> const std::string* {
    const Value* v = args.get(index, key);
    if (v == nullptr || v->is_none()) return nullptr;
    return &expect_string(*v, cat("str.", name, "() argument"), line);
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    args.expect(cat("str.", name), 1, {});
    return strip_tracked(TrackedText{text, receiver.untrusted_ranges()}, optional_string(0, ""),
                         name != "rstrip", name != "lstrip");
  }
  if (name == "split" || name == "rsplit") {
    args.expect(cat("str.", name), 2, {"sep", "maxsplit"});
    const Value* maxsplit = args.get(1, "maxsplit");
    return string_list(split_text(text, optional_string(0, "sep"),
                                  maxsplit ? expect_int(*maxsplit, "maxsplit", line) : -1,
                                  name == "rsplit", line));
  }
  if (name == "splitlines") {
    args.expect("str.splitlines", 1, {"keepends"});
    return string_list(split_lines(text, arg_bool(args, 0, "keepends", false)));
  }
  if (name == "startswith" || name == "endswith") {
    args.expect(cat("str.", name), 1, {});
    if (args.positional.empty()) fail(line, cat("str.", name, "() takes at least 1 argument"));
    const Value& what = args.positional[0];
    std::vector<std::string> candidates;
    if (what.is_string()) {
      candidates.push_back(what.as_string());
    } else if (what.is_array()) {
      for (const Value& item : what.as_array().items) {
        candidates.push_back(expect_string(item, cat("str.", name, "() tuple item"), line));
      }
    } else {
      fail(line, cat(name, " first arg must be str or a tuple of str, not ", what.type_name()));
    }
    for (const std::string& c : candidates) {
      if (name == "startswith" ? text.starts_with(c) : text.ends_with(c))
        return Value::boolean(true);
    }
    return Value::boolean(false);
  }
  if (name == "upper" || name == "lower" || name == "casefold") {
    args.expect(cat("str.", name), 0, {});
    return Value::string(name == "upper" ? ascii_upper(text) : ascii_lower(text));
  }
  if (name == "title") {
    args.expect("str.title", 0, {});
    return Value::string(python_title(text));
  }
  if (name == "capitalize") {
    args.expect("str.capitalize", 0, {});
    return Value::string(capitalize(text));
  }
  if (name == "replace") {
    args.expect("str.replace", 3, {"count"});
    if (args.positional.size() < 2) fail(line, "str.replace() takes at least 2 arguments");
    const Value* count = args.get(2, "count");
    const std::string out =
        replace_all(text, expect_string(args.positional[0], "str.replace() argument", line),
                    expect_string(args.positional[1], "str.replace() argument", line),
                    count ? expect_int(*count, "count", line) : -1);
    check_size(out.size(), line);
    return Value::string(out);
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    args.expect(cat("str.", name), 1, {});
    if (args.positional.empty()) fail(line, cat("str.", name, "() takes at least 1 argument"));
    const std::string& needle =
        expect_string(args.positional[0], cat("str.", name, "() argument"), line);
    if (name == "count") {
      if (needle.empty()) return Value::integer(static_cast<int64_t>(utf8_length(text)) + 1);
      int64_t count = 0;
      for (size_t pos = text.find(needle); pos != std::string::npos;
           pos = text.find(needle, pos + needle.size())) {
        ++count;
      }
      return Value::integer(count);
    }
    const bool reverse = name == "rfind" || name == "rindex";
    const size_t hit = reverse ? text.rfind(needle) : text.find(needle);
    if (hit == std::string::npos) {
      if (name == "index" || name == "rindex") fail(line, "substring not found");
      return Value::integer(-1);
    }
    return Value::integer(static_cast<int64_t>(utf8_length(std::string_view(text).substr(0, hit))));
  }
  if (name == "join") {
    args.expect("str.join", 1, {});
    if (args.positional.empty()) fail(line, "str.join() takes exactly one argument");
    TrackedText out;
    bool first = true;
    for (const Value& item : iterate(args.positional[0], line)) {
      if (!first) out.append(text, receiver.untrusted_ranges());
      first = false;
      out.append(expect_string(item, "str.join() item", line), item.untrusted_ranges());
      check_size(out.text.size(), line);
    }
    return Value::string(std::move(out.text), std::move(out.untrusted));
  }
  if (name == "format") {
    const std::string out = python_format(text, args);
    check_size(out.size(), line);
    return Value::string(out);
  }
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric" || name == "isalpha" ||
      name == "isalnum" || name == "isspace" || name == "islower" || name == "isupper") {
    args.expect(cat("str.", name), 0, {});
    if (name == "islower") return Value::boolean(python_is_lower(text));
    if (name == "isupper") return Value::boolean(python_is_upper(text));
    const auto chars = decode(text);
    if (chars.empty()) return Value::boolean(false);
    for (const Char& c : chars) {
      const bool digit = c.cp >= '0' && c.cp <= '9';
      const bool ok = name == "isspace"   ? is_python_space(c.cp)
                      : name == "isalpha" ? is_cased(c.cp)
                      : name == "isalnum" ? (is_cased(c.cp) || digit)
                                          : digit;
      if (!ok) return Value::boolean(false);
    }
    return Value::boolean(true);
  }
  if (name == "removeprefix" || name == "removesuffix") {
    args.expect(cat("str.", name), 1, {});
    if (args.positional.empty()) fail(line, cat("str.", name, "() takes exactly one argument"));
    const std::string& affix =
        expect_string(args.positional[0], cat("str.", name, "() argument"), line);
    const ByteRanges& untrusted = receiver.untrusted_ranges();
    if (name == "removeprefix" && text.starts_with(affix)) {
      return Value::string(text.substr(affix.size()),
                           slice_ranges(untrusted, affix.size(), text.size()));
    }
    if (name == "removesuffix" && !affix.empty() && text.ends_with(affix)) {
      const size_t end = text.size() - affix.size();
      return Value::string(text.substr(0, end), slice_ranges(untrusted, 0, end));
    }
    return receiver;
  }
  fail(line, cat("unsupported method 'str.", name, "'"));
}

// ---- Filters ------------------------------------------------------------------------------------

namespace {

// Filters whose result keeps track of its untrusted ranges itself (an operand or argument passed
// through, parts of them, or a number) ...
constexpr std::string_view kTrackedFilters[] = {"safe", "default", "d",        "string", "trim",
                                                "join", "length",  "count",    "int",    "float",
                                                "abs",  "round",   "wordcount"};
// ... and those that do so unless the operand is a string (whose items are new strings).
constexpr std::string_view kPassThroughFilters[] = {
    "first", "last", "list",   "reverse", "sort",       "unique",    "min",
    "max",   "attr", "select", "reject",  "selectattr", "rejectattr"};

}  // namespace

Value Interpreter::apply_tracked_filter(std::string_view name, const Value& operand,
                                        const CallArgs& args) {
  const bool inputs_untrusted = holds_untrusted(operand) || args_hold_untrusted(args);
  const bool tracked = contains(kTrackedFilters, name) ||
                       (contains(kPassThroughFilters, name) && !operand.is_string()) ||
                       (name == "map" && args.keyword_arg("attribute") != nullptr);
  return track_builtin_result(apply_filter(name, operand, args), inputs_untrusted, tracked);
}

Value Interpreter::apply_filter(std::string_view name, const Value& value, const CallArgs& args) {
  const int line = args.line;
  const std::string what = cat("filter '", name, "'");
  if (name == "safe") {
    args.expect(what, 0, {});
    return value;
  }
  if (name == "default" || name == "d") {
    args.expect(what, 2, {"default_value", "boolean"});
    const Value* fallback = args.get(0, "default_value");
    const bool boolean = arg_bool(args, 1, "boolean", false);
    if (value.is_undefined() || (boolean && !value.truthy())) {
      return fallback ? *fallback : Value::string("");
    }
    return value;
  }
  if (name == "tojson") {
    // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False).
    args.expect(what, 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
    JsonFormat format;
    format.ensure_ascii = arg_bool(args, 0, "ensure_ascii", false);
    if (const Value* indent = args.get(1, "indent"); indent && !indent->is_none()) {
      if (indent->is_string()) {
        format.indent = indent->as_string();
      } else {
        const int64_t n = expect_int(*indent, "tojson indent", line);
        format.indent = std::string(static_cast<size_t>(std::clamp<int64_t>(n, 0, 1000)), ' ');
      }
    }
    if (const Value* separators = args.get(2, "separators"); separators && !separators->is_none()) {
      if (!separators->is_array() || separators->as_array().items.size() != 2) {
        fail(line, "tojson separators must be a pair of strings");
      }
      format.item_separator =
          expect_string(separators->as_array().items[0], "tojson separator", line);
      format.key_separator =
          expect_string(separators->as_array().items[1], "tojson separator", line);
    }
    format.sort_keys = arg_bool(args, 3, "sort_keys", false);
    try {
      std::string text = to_json_text(value, format);
      check_size(text.size(), line);
      return Value::string(std::move(text));
    } catch (TemplateError& error) {
      error.line = line;
      throw;
    }
  }
  if (name == "string") {
    args.expect(what, 0, {});
    if (value.is_string()) return value;
    TrackedText text = to_tracked_str(value);
    return Value::string(std::move(text.text), std::move(text.untrusted));
  }
  if (name == "length" || name == "count") {
    args.expect(what, 0, {});
    switch (value.kind()) {
      case Value::Kind::string:
        return Value::integer(static_cast<int64_t>(utf8_length(value.as_string())));
      case Value::Kind::array:
        return Value::integer(static_cast<int64_t>(value.as_array().items.size()));
      case Value::Kind::object:
        return Value::integer(static_cast<int64_t>(value.as_object().entries.size()));
      case Value::Kind::undefined:
        return Value::integer(0);
      default:
        fail(line, cat("object of type '", value.type_name(), "' has no len()"));
    }
  }
  if (name == "trim") {
    args.expect(what, 1, {"chars"});
    const Value* chars = args.get(0, "chars");
    const std::string* set =
        chars && !chars->is_none() ? &expect_string(*chars, "trim chars", line) : nullptr;
    return strip_tracked(to_tracked_str(value), set, true, true);
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
    args.expect(what, 0, {});
    const std::string text = to_str(value);
    if (name == "upper") return Value::string(ascii_upper(text));
    if (name == "lower") return Value::string(ascii_lower(text));
    if (name == "capitalize") return Value::string(capitalize(text));
    return Value::string(jinja_title(text));
  }
  if (name == "replace") {
    args.expect(what, 3, {"old", "new", "count"});
    const Value* from = args.get(0, "old");
    const Value* to = args.get(1, "new");
    if (from == nullptr || to == nullptr) fail(line, "filter 'replace' takes old and new");
    const Value* count = args.get(2, "count");
    std::string out =
        replace_all(to_str(value), to_str(*from), to_str(*to),
                    count && !count->is_none() ? expect_int(*count, "count", line) : -1);
    check_size(out.size(), line);
    return Value::string(std::move(out));
  }
  if (name == "indent") {
    args.expect(what, 3, {"width", "first", "blank"});
    const Value* width = args.get(0, "width");
    std::string indention = "    ";
    if (width != nullptr) {
      indention = width->is_string()
                      ? width->as_string()
                      : std::string(static_cast<size_t>(std::clamp<int64_t>(
                                        expect_int(*width, "indent width", line), 0, 1000)),
                                    ' ');
    }
    const bool first = arg_bool(args, 1, "first", false);
    const bool blank = arg_bool(args, 2, "blank", false);
    const std::vector<std::string> lines = split_lines(to_str(value) + "\n", false);
    std::string out;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) out += '\n';
      const bool indent_line = i == 0 ? first : (blank || !lines[i].empty());
      if (indent_line) out += indention;
      out += lines[i];
    }
    check_size(out.size(), line);
    return Value::string(std::move(out));
  }
  if (name == "escape" || name == "e" || name == "forceescape") {
    args.expect(what, 0, {});
    return Value::string(html_escape(to_str(value)));
  }
  if (name == "int") {
    args.expect(what, 2, {"default", "base"});
    const Value* fallback = args.get(0, "default");
    const Value* base = args.get(1, "base");
    const Value result_default = fallback ? *fallback : Value::integer(0);
    if (value.is_int()) return value;
    if (value.is_bool()) return Value::integer(value.as_bool() ? 1 : 0);
    if (value.is_float()) {
      const double v = value.as_float();
      if (!std::isfinite(v) || std::fabs(v) >= 9.2e18) return result_default;
      return Value::integer(static_cast<int64_t>(v));
    }
    if (value.is_string()) {
      if (auto v = parse_int(value.as_string(),
                             base ? static_cast<int>(expect_int(*base, "base", line)) : 10)) {
        return Value::integer(*v);
      }
      if (auto f = parse_float(value.as_string());
          f && std::isfinite(*f) && std::fabs(*f) < 9.2e18) {
        return Value::integer(static_cast<int64_t>(*f));
      }
    }
    return result_default;
  }
  if (name == "float") {
    args.expect(what, 1, {"default"});
    const Value* fallback = args.get(0, "default");
    if (value.is_float()) return value;
    if (value.is_int() || value.is_bool()) return Value::floating(value.as_number());
    if (value.is_string()) {
      if (auto f = parse_float(value.as_string())) return Value::floating(*f);
    }
    return fallback ? *fallback : Value::floating(0.0);
  }
  if (name == "abs") {
    args.expect(what, 0, {});
    if (value.is_float()) return Value::floating(std::fabs(value.as_float()));
    if (value.is_int() || value.is_bool()) {
      const int64_t v = value.is_int() ? value.as_int() : value.as_bool();
      if (v == std::numeric_limits<int64_t>::min()) fail(line, "integer overflow");
      return Value::integer(v < 0 ? -v : v);
    }
    fail(line, cat("bad operand type for abs(): '", value.type_name(), "'"));
  }
  if (name == "round") {
    args.expect(what, 2, {"precision", "method"});
    const Value* precision_arg = args.get(0, "precision");
    const int64_t precision = precision_arg ? expect_int(*precision_arg, "precision", line) : 0;
    const Value* method_arg = args.get(1, "method");
    const std::string method = method_arg ? to_str(*method_arg) : "common";
    if (!value.is_number())
      fail(line, cat("filter 'round' needs a number, got ", value.type_name()));
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = value.as_number() * scale;
    double r = 0;
    if (method == "common") {
      r = std::nearbyint(x);  // Python's round(): half to even
    } else if (method == "ceil") {
      r = std::ceil(x);
    } else if (method == "floor") {
      r = std::floor(x);
    } else {
      fail(line, "filter 'round' method must be 'common', 'ceil' or 'floor'");
    }
    return Value::floating(r / scale);
  }
  if (name == "wordcount") {
    args.expect(what, 0, {});
    int64_t words = 0;
    bool in_word = false;
    for (const Char& c : decode(to_str(value))) {
      const bool word_char = c.cp == '_' || (c.cp >= '0' && c.cp <= '9') || is_ascii_alpha(c.cp) ||
                             (c.cp >= 0x80 && !is_python_space(c.cp));
      if (word_char && !in_word) ++words;
      in_word = word_char;
    }
    return Value::integer(words);
  }
  if (name == "attr") {
    args.expect(what, 1, {});
    if (args.positional.empty()) fail(line, "filter 'attr' takes an attribute name");
    return get_attribute(value, expect_string(args.positional[0], "attribute name", line), line);
  }
  if (name == "items") {
    args.expect(what, 0, {});
    if (value.is_undefined()) return Value::array({});
    if (!value.is_object())
      fail(line, cat("filter 'items' needs a mapping, got ", value.type_name()));
    std::vector<Value> out;
    for (const auto& [k, v] : value.as_object().entries) {
      out.push_back(Value::array({Value::string(k), v}, /*is_tuple=*/true));
    }
    return Value::array(std::move(out));
  }
  if (name == "dictsort") {
    args.expect(what, 3, {"case_sensitive", "by", "reverse"});
    if (!value.is_object())
      fail(line, cat("filter 'dictsort' needs a mapping, got ", value.type_name()));
    const bool case_sensitive = arg_bool(args, 0, "case_sensitive", false);
    const Value* by_arg = args.get(1, "by");
    const std::string by = by_arg ? to_str(*by_arg) : "key";
    if (by != "key" && by != "value") fail(line, "You can only sort by either 'key' or 'value'");
    const bool reverse = arg_bool(args, 2, "reverse", false);
    std::vector<Value> pairs;
    for (const auto& [k, v] : value.as_object().entries) {
      pairs.push_back(Value::array({Value::string(k), v}, /*is_tuple=*/true));
    }
    const size_t pick = by == "key" ? 0 : 1;
    std::stable_sort(pairs.begin(), pairs.end(), [&](const Value& a, const Value& b) {
      const int c = compare_values(sort_key(a.as_array().items[pick], case_sensitive),
                                   sort_key(b.as_array().items[pick], case_sensitive), line);
      return reverse ? c > 0 : c < 0;
    });
    return Value::array(std::move(pairs));
  }

  // The filters below walk a sequence.
  if (name == "list") {
    args.expect(what, 0, {});
    return Value::array(iterate(value, line));
  }
  if (name == "first" || name == "last") {
    args.expect(what, 0, {});
    std::vector<Value> items = iterate(value, line);
    if (items.empty()) return Value::undefined();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    args.expect(what, 0, {});
    if (value.is_string()) {
      auto chars = utf8_chars(value.as_string());
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out.append(*it);
      return Value::string(std::move(out));
    }
    std::vector<Value> items = iterate(value, line);
    std::reverse(items.begin(), items.end());
    return Value::array(std::move(items));
  }
  if (name == "join") {
    args.expect(what, 2, {"d", "attribute"});
    const Value* separator = args.get(0, "d");
    const Value* attribute = args.get(1, "attribute");
    const TrackedText sep = separator ? to_tracked_str(*separator) : TrackedText{};
    TrackedText out;
    bool first = true;
    for (const Value& item : iterate(value, line)) {
      if (!first) out.append(sep);
      first = false;
      out.append(to_tracked_str(attribute && !attribute->is_none()
                                    ? resolve_path(*this, item, to_str(*attribute), line)
                                    : item));
      check_size(out.text.size(), line);
    }
    return Value::string(std::move(out.text), std::move(out.untrusted));
  }
  if (name == "sort" || name == "unique" || name == "min" || name == "max") {
    const bool is_sort = name == "sort";
    if (is_sort) {
      args.expect(what, 3, {"reverse", "case_sensitive", "attribute"});
    } else {
      args.expect(what, 2, {"case_sensitive", "attribute"});
    }
    const bool reverse = is_sort && arg_bool(args, 0, "reverse", false);
    const bool case_sensitive = arg_bool(args, is_sort ? 1 : 0, "case_sensitive", false);
    const Value* attribute = args.get(is_sort ? 2 : 1, "attribute");
    std::vector<Value> items = iterate(value, line);
    auto key = [&](const Value& item) {
      return sort_key(attribute && !attribute->is_none()
                          ? resolve_path(*this, item, to_str(*attribute), line)
                          : item,
                      case_sensitive);
    };
    if (is_sort) {
      std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        const int c = compare_values(key(a), key(b), line);
        return reverse ? c > 0 : c < 0;
      });
      return Value::array(std::move(items));
    }
    if (name == "unique") {
      std::vector<Value> seen;
      std::vector<Value> out;
      for (const Value& item : items) {
        const Value k = key(item);
        if (std::none_of(seen.begin(), seen.end(),
                         [&](const Value& s) { return values_equal(s, k); })) {
          seen.push_back(k);
          out.push_back(item);
        }
      }
      return Value::array(std::move(out));
    }
    if (items.empty()) return Value::undefined();
    size_t best = 0;
    for (size_t i = 1; i < items.size(); ++i) {
      const int c = compare_values(key(items[i]), key(items[best]), line);
      if (name == "min" ? c < 0 : c > 0) best = i;
    }
    return items[best];
  }
  if (name == "sum") {
    args.expect(what, 2, {"attribute", "start"});
    const Value* attribute = args.get(0, "attribute");
    const Value* start = args.get(1, "start");
    Value total = start ? *start : Value::integer(0);
    for (const Value& item : iterate(value, line)) {
      const Value v = attribute && !attribute->is_none()
                          ? resolve_path(*this, item, to_str(*attribute), line)
                          : item;
      if (!total.is_number() || !v.is_number()) {
        fail(line, cat("unsupported operand type(s) for +: '", total.type_name(), "' and '",
                       v.type_name(), "'"));
      }
      if ((total.is_int() || total.is_bool()) && (v.is_int() || v.is_bool())) {
        int64_t sum = 0;
        if (__builtin_add_overflow(static_cast<int64_t>(total.as_number()),
                                   static_cast<int64_t>(v.as_number()), &sum)) {
          fail(line, "integer overflow");
        }
        total = Value::integer(sum);
      } else {
        total = Value::floating(total.as_number() + v.as_number());
      }
    }
    return total;
  }
  if (name == "map") {
    std::vector<Value> out;
    if (const Value* attribute = args.keyword_arg("attribute")) {
      args.expect(what, 0, {"attribute", "default"});
      const Value* fallback = args.keyword_arg("default");
      for (const Value& item : iterate(value, line)) {
        Value v = resolve_path(*this, item, to_str(*attribute), line);
        out.push_back(v.is_undefined() && fallback ? *fallback : std::move(v));
      }
      return Value::array(std::move(out));
    }
    if (args.positional.empty()) fail(line, "filter 'map' needs a filter name or attribute=");
    const std::string filter = to_str(args.positional[0]);
    if (!is_known_filter(filter)) fail(line, cat("unsupported filter '", filter, "'"));
    CallArgs rest = args;
    rest.positional.erase(rest.positional.begin());
    for (const Value& item : iterate(value, line)) out.push_back(apply_filter(filter, item, rest));
    return Value::array(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool by_attribute = name == "selectattr" || name == "rejectattr";
    const bool keep_matching = name == "select" || name == "selectattr";
    args.expect(what, 64, {});
    size_t next_arg = 0;
    std::string attribute;
    if (by_attribute) {
      if (args.positional.empty()) fail(line, cat(what, " needs an attribute name"));
      attribute = to_str(args.positional[next_arg++]);
    }
    std::string test;
    if (next_arg < args.positional.size()) {
      test = to_str(args.positional[next_arg++]);
      if (!is_known_test(test)) fail(line, cat("unsupported test '", test, "'"));
    }
    CallArgs test_args;
    test_args.line = line;
    test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(next_arg),
                                args.positional.end());
    std::vector<Value> out;
    for (const Value& item : iterate(value, line)) {
      const Value subject = by_attribute ? resolve_path(*this, item, attribute, line) : item;
      const bool matches = test.empty() ? subject.truthy() : apply_test(test, subject, test_args);
      if (matches == keep_matching) out.push_back(item);
    }
    return Value::array(std::move(out));
  }
  fail(line, cat("unsupported filter '", name, "'"));
}

// ---- Tests --------------------------------------------------------------------------------------

bool Interpreter::apply_test(std::string_view name, const Value& value, const CallArgs& args) {
  const int line = args.line;
  auto argument = [&]() -> const Value& {
    if (args.positional.empty()) fail(line, cat("test '", name, "' takes one argument"));
    return args.positional[0];
  };
  if (name == "defined") return !value.is_undefined();
  if (name == "undefined") return value.is_undefined();
  if (name == "none") return value.is_none();
  if (name == "boolean") return value.is_bool();
  if (name == "true") return value.is_bool() && value.as_bool();
  if (name == "false") return value.is_bool() && !value.as_bool();
  if (name == "integer") return value.is_int();
  if (name == "float") return value.is_float();
  if (name == "number") return value.is_number();
  if (name == "string") return value.is_string();
  if (name == "mapping") return value.is_object();
  if (name == "iterable") {
    return value.is_string() || value.is_array() || value.is_object() || value.is_undefined();
  }
  if (name == "sequence") {
    return value.is_string() || value.is_array() || value.is_object() || value.is_undefined();
  }
  if (name == "callable") return value.is_callable();
  if (name == "escaped") return false;
  if (name == "lower") return python_is_lower(to_str(value));
  if (name == "upper") return python_is_upper(to_str(value));
  if (name == "filter") return value.is_string() && is_known_filter(value.as_string());
  if (name == "test") return value.is_string() && is_known_test(value.as_string());
  if (name == "odd" || name == "even") {
    const int64_t v = expect_int(value, cat("test '", name, "' operand"), line);
    return (v % 2 != 0) == (name == "odd");
  }
  if (name == "divisibleby") {
    const int64_t d = expect_int(argument(), "divisibleby argument", line);
    if (d == 0) fail(line, "integer division or modulo by zero");
    return expect_int(value, "divisibleby operand", line) % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return values_equal(value, argument());
  if (name == "ne" || name == "!=") return !values_equal(value, argument());
  if (name == "sameas") {
    const Value& other = argument();
    if (value.is_array() || value.is_object()) {
      return value.kind() == other.kind() &&
             (value.is_array() ? &value.as_array() == &other.as_array()
                               : &value.as_object() == &other.as_object());
    }
    return value.kind() == other.kind() && values_equal(value, other);
  }
  if (name == "in") {
    const Value& container = argument();
    if (container.is_string()) {
      return value.is_string() &&
             container.as_string().find(value.as_string()) != std::string::npos;
    }
    if (container.is_object())
      return value.is_string() && container.as_object().find(value.as_string());
    for (const Value& item : iterate(container, line)) {
      if (values_equal(item, value)) return true;
    }
    return false;
  }
  if (value.is_undefined()) fail_undefined(value, line);
  const int c = compare_values(value, argument(), line);
  if (name == "lt" || name == "lessthan" || name == "<") return c < 0;
  if (name == "le" || name == "<=") return c <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return c > 0;
  if (name == "ge" || name == ">=") return c >= 0;
  fail(line, cat("unsupported test '", name, "'"));
}

// ---- Globals ------------------------------------------------------------------------------------

void Interpreter::add_globals(Scope& scope) {
  scope.set("range", Value::callable("range", [](Interpreter&, const CallArgs& args) {
              args.expect("range", 3, {});
              if (args.positional.empty()) fail(args.line, "range expected at least 1 argument");
              int64_t start = 0;
              int64_t stop = 0;
              int64_t step = 1;
              if (args.positional.size() == 1) {
                stop = expect_int(args.positional[0], "range argument", args.line);
              } else {
                start = expect_int(args.positional[0], "range argument", args.line);
                stop = expect_int(args.positional[1], "range argument", args.line);
                if (args.positional.size() == 3) {
                  step = expect_int(args.positional[2], "range argument", args.line);
                }
              }
              if (step == 0) fail(args.line, "range() arg 3 must not be zero");
              std::vector<Value> items;
              for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
                if (static_cast<int64_t>(items.size()) >= kMaxRange) {
                  fail(args.line, cat("Range too big. The sandbox blocks ranges larger than "
                                      "MAX_RANGE (",
                                      kMaxRange, ")."));
                }
                items.push_back(Value::integer(i));
              }
              return Value::array(std::move(items));
            }));
  scope.set("namespace", Value::callable("namespace", [](Interpreter&, const CallArgs& args) {
              ObjectData data;
              if (args.positional.size() > 1) {
                fail(args.line, "namespace() takes at most one positional argument");
              }
              if (!args.positional.empty()) {
                const Value& init = args.positional[0];
                if (!init.is_object()) {
                  fail(args.line, cat("namespace() takes a mapping, got ", init.type_name()));
                }
                data = init.as_object();
              }
              for (const auto& [k, v] : args.keyword) data.set(k, v);
              return Value::make_namespace(std::move(data));
            }));
  scope.set("dict", Value::callable("dict", [](Interpreter&, const CallArgs& args) {
              ObjectData data;
              if (!args.positional.empty()) {
                if (args.positional.size() > 1 || !args.positional[0].is_object()) {
                  fail(args.line, "dict() takes one mapping and keyword arguments");
                }
                data = args.positional[0].as_object();
              }
              for (const auto& [k, v] : args.keyword) data.set(k, v);
              return Value::object(std::move(data));
            }));
  scope.set("raise_exception",
            Value::callable("raise_exception", [](Interpreter&, const CallArgs& args) -> Value {
              const std::string message = args.positional.empty() ? "" : to_str(args.positional[0]);
              fail(args.line, cat("the template raised an error: ", message));
            }));
  scope.set("strftime_now", Value::callable("strftime_now", [](Interpreter&, const CallArgs& args) {
              args.expect("strftime_now", 1, {});
              if (args.positional.empty()) fail(args.line, "strftime_now() takes a format");
              const std::string& format =
                  expect_string(args.positional[0], "strftime_now format", args.line);
              const std::time_t now = std::time(nullptr);
              std::tm local{};
              localtime_r(&now, &local);
              char buffer[512];
              const size_t n = std::strftime(buffer, sizeof(buffer), format.c_str(), &local);
              return Value::string(std::string(buffer, n));
            }));
}

}  // namespace e4kv::jinja
