#include "chat/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/status.h"
#include "core/utf8.h"

namespace e4kv::jinja {

void fail(int line, std::string message) {
  throw TemplateError{line, std::move(message)};
}

// ---- Caller's-data ranges ----------------------------------------------------------------------

void add_range(ByteRanges& ranges, size_t begin, size_t end) {
  if (begin >= end) return;
  // Ranges arrive mostly in order (appending text): merge with the last one when they touch.
  if (ranges.empty() || ranges.back().second < begin) {
    ranges.emplace_back(begin, end);
    return;
  }
  if (ranges.back().first <= begin) {
    ranges.back().second = std::max(ranges.back().second, end);
    return;
  }
  ranges.emplace_back(begin, end);
  std::sort(ranges.begin(), ranges.end());
  ByteRanges merged;
  for (const auto& [b, e] : ranges) {
    if (!merged.empty() && merged.back().second >= b) {
      merged.back().second = std::max(merged.back().second, e);
    } else {
      merged.emplace_back(b, e);
    }
  }
  ranges = std::move(merged);
}

ByteRanges slice_ranges(const ByteRanges& ranges, size_t begin, size_t end) {
  ByteRanges out;
  for (const auto& [b, e] : ranges) {
    const size_t from = std::max(b, begin);
    const size_t to = std::min(e, end);
    if (from < to) out.emplace_back(from - begin, to - begin);
  }
  return out;
}

bool overlaps(const ByteRanges& ranges, size_t begin, size_t end) {
  for (const auto& [b, e] : ranges) {
    if (b < end && begin < e) return true;
  }
  return false;
}

void TrackedText::append(std::string_view more, const ByteRanges& more_untrusted) {
  const size_t offset = text.size();
  text.append(more);
  for (const auto& [b, e] : more_untrusted) add_range(untrusted, offset + b, offset + e);
}

// ---- Containers and arguments -------------------------------------------------------------------

const Value* ObjectData::find(std::string_view key) const {
  for (const auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

Value* ObjectData::find(std::string_view key) {
  for (auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

void ObjectData::set(std::string key, Value value) {
  if (Value* slot = find(key)) {
    *slot = std::move(value);
  } else {
    entries.emplace_back(std::move(key), std::move(value));
  }
}

const Value* CallArgs::keyword_arg(std::string_view name) const {
  for (const auto& [k, v] : keyword) {
    if (k == name) return &v;
  }
  return nullptr;
}

const Value* CallArgs::get(size_t index, std::string_view name) const {
  if (index < positional.size()) return &positional[index];
  return keyword_arg(name);
}

void CallArgs::expect(std::string_view what, size_t max_positional,
                      std::initializer_list<std::string_view> names) const {
  if (positional.size() > max_positional) {
    fail(line, cat(what, " takes at most ", max_positional, " positional argument(s), got ",
                   positional.size()));
  }
  for (const auto& [k, v] : keyword) {
    if (std::find(names.begin(), names.end(), k) == names.end()) {
      fail(line, cat(what, " got an unexpected keyword argument '", k, "'"));
    }
  }
}

// ---- Construction -------------------------------------------------------------------------------

Value Value::undefined(std::string name) {
  return Value(Undefined{std::move(name)});
}
Value Value::none() {
  return Value(None{});
}
Value Value::boolean(bool v) {
  return Value(v);
}
Value Value::integer(int64_t v) {
  return Value(v);
}
Value Value::floating(double v) {
  return Value(v);
}
Value Value::string(std::string v, ByteRanges untrusted) {
  return Value(StringData{std::move(v), std::move(untrusted)});
}
Value Value::untrusted_string(std::string v) {
  ByteRanges untrusted;
  add_range(untrusted, 0, v.size());
  return string(std::move(v), std::move(untrusted));
}
Value Value::array(std::vector<Value> items, bool is_tuple) {
  return Value(std::make_shared<const ArrayData>(ArrayData{std::move(items), is_tuple}));
}
Value Value::object(ObjectData data) {
  return Value(std::make_shared<const ObjectData>(std::move(data)));
}
Value Value::make_namespace(ObjectData data) {
  return Value(Namespace{std::make_shared<ObjectData>(std::move(data))});
}
Value Value::loop(LoopData data) {
  return Value(std::move(data));
}
Value Value::callable(std::string name, std::function<Value(Interpreter&, const CallArgs&)> call) {
  return Value(std::make_shared<const Callable>(Callable{std::move(name), std::move(call)}));
}

Value Value::from_json(const nlohmann::ordered_json& json, bool untrusted, int depth) {
  if (depth > kMaxJsonDepth)
    fail(0, cat("the JSON input nests deeper than ", kMaxJsonDepth, " levels"));
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return boolean(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return integer(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto v = json.get<uint64_t>();
      if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return integer(static_cast<int64_t>(v));
      }
      return floating(static_cast<double>(v));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return floating(json.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return untrusted ? untrusted_string(json.get<std::string>())
                       : string(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(from_json(item, untrusted, depth + 1));
      return array(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      ObjectData data;
      data.untrusted_keys = untrusted;
      data.entries.reserve(json.size());
      for (const auto& [key, item] : json.items())
        data.entries.emplace_back(key, from_json(item, untrusted, depth + 1));
      return object(std::move(data));
    }
    default:  // binary, discarded
      fail(0, "unsupported JSON value (binary or discarded)");
  }
}

nlohmann::ordered_json Value::to_json() const {
  switch (kind()) {
    case Kind::none:
      return nullptr;
    case Kind::boolean:
      return as_bool();
    case Kind::integer:
      return as_int();
    case Kind::floating:
      return as_float();
    case Kind::string:
      return as_string();
    case Kind::array: {
      auto out = nlohmann::ordered_json::array();
      for (const Value& item : as_array().items) out.push_back(item.to_json());
      return out;
    }
    case Kind::object: {
      auto out = nlohmann::ordered_json::object();
      for (const auto& [k, v] : as_object().entries) out[k] = v.to_json();
      return out;
    }
    default:
      fail(0, cat("a value of type ", type_name(), " has no JSON form"));
  }
}

double Value::as_number() const {
  if (is_int()) return static_cast<double>(as_int());
  if (is_bool()) return as_bool() ? 1.0 : 0.0;
  return as_float();
}

bool Value::truthy() const {
  switch (kind()) {
    case Kind::undefined:
    case Kind::none:
      return false;
    case Kind::boolean:
      return as_bool();
    case Kind::integer:
      return as_int() != 0;
    case Kind::floating:
      return as_float() != 0.0;
    case Kind::string:
      return !as_string().empty();
    case Kind::array:
      return !as_array().items.empty();
    case Kind::object:
      return !as_object().entries.empty();
    default:
      return true;
  }
}

std::string Value::type_name() const {
  switch (kind()) {
    case Kind::undefined:
      return "Undefined";
    case Kind::none:
      return "NoneType";
    case Kind::boolean:
      return "bool";
    case Kind::integer:
      return "int";
    case Kind::floating:
      return "float";
    case Kind::string:
      return "str";
    case Kind::array:
      return as_array().is_tuple ? "tuple" : "list";
    case Kind::object:
      return "dict";
    case Kind::ns:
      return "Namespace";
    case Kind::loop:
      return "LoopContext";
    case Kind::callable:
      return "function";
  }
  return "?";
}

// ---- UTF-8 --------------------------------------------------------------------------------------

bool is_python_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

size_t utf8_length(std::string_view text) {
  size_t count = 0;
  for (size_t pos = 0; pos < text.size(); pos += utf8_step(text, pos).length) ++count;
  return count;
}

std::vector<std::string_view> utf8_chars(std::string_view text) {
  std::vector<std::string_view> chars;
  chars.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const size_t length = utf8_step(text, pos).length;
    chars.push_back(text.substr(pos, length));
    pos += length;
  }
  return chars;
}

// ---- Python str() and repr() --------------------------------------------------------------------

std::string float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  if (value == 0.0) return std::signbit(value) ? "-0.0" : "0.0";
  // The shortest round-trip digits, then Python's layout: positional for 1e-4 <= |x| < 1e16,
  // otherwise d.ddde+XX with at least two exponent digits.
  char buffer[64];
  const auto result =
      std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  const std::string text(buffer, result.ptr);
  const size_t e_pos = text.find('e');
  std::string mantissa = text.substr(0, e_pos);
  const int exponent = std::stoi(text.substr(e_pos + 1));
  const bool negative = mantissa[0] == '-';
  if (negative) mantissa.erase(0, 1);
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits += c;
  }
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out += "0.";
      out.append(static_cast<size_t>(-exponent - 1), '0');
      out += digits;
    } else {
      const auto int_digits = static_cast<size_t>(exponent) + 1;
      if (digits.size() <= int_digits) {
        out += digits;
        out.append(int_digits - digits.size(), '0');
        out += ".0";
      } else {
        out += digits.substr(0, int_digits);
        out += '.';
        out += digits.substr(int_digits);
      }
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char exp_text[16];
  std::snprintf(exp_text, sizeof(exp_text), "e%c%02d", exponent < 0 ? '-' : '+',
                exponent < 0 ? -exponent : exponent);
  return out + exp_text;
}

namespace {

// Characters Python's str.isprintable() rejects among those a chat message may carry: C0/C1
// controls, DEL and the common Unicode spaces and format characters. (Python's full table is the
// Unicode database; these are the ones that show up in practice.)
bool python_unprintable(char32_t cp) {
  return cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) ||
         (cp >= 0x205F && cp <= 0x2064) || cp == 0x3000 || cp == 0xFEFF;
}

std::string string_repr(std::string_view text) {
  const bool has_single = text.find('\'') != std::string_view::npos;
  const bool has_double = text.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (size_t pos = 0; pos < text.size();) {
    const Utf8Step step = utf8_step(text, pos);
    if (!step.valid) {
      char hex[8];
      std::snprintf(hex, sizeof(hex), "\\x%02x",
                    static_cast<unsigned>(static_cast<uint8_t>(text[pos])));
      out += hex;
      pos += step.length;
      continue;
    }
    const char32_t cp = utf8_decode(text, pos, step.length);
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == static_cast<char32_t>(quote)) {
      out += '\\';
      out += quote;
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (python_unprintable(cp)) {
      char hex[16];
      if (cp <= 0xFF) {
        std::snprintf(hex, sizeof(hex), "\\x%02x", static_cast<unsigned>(cp));
      } else {
        std::snprintf(hex, sizeof(hex), "\\u%04x", static_cast<unsigned>(cp));
      }
      out += hex;
    } else {
      out.append(text.substr(pos, step.length));
    }
    pos += step.length;
  }
  out += quote;
  return out;
}

}  // namespace

std::string to_repr(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::string:
      return string_repr(value.as_string());
    case Value::Kind::array: {
      const ArrayData& array = value.as_array();
      std::string out = array.is_tuple ? "(" : "[";
      for (size_t i = 0; i < array.items.size(); ++i) {
        if (i > 0) out += ", ";
        out += to_repr(array.items[i]);
      }
      if (array.is_tuple && array.items.size() == 1) out += ",";
      return out + (array.is_tuple ? ")" : "]");
    }
    case Value::Kind::object: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : value.as_object().entries) {
        if (!first) out += ", ";
        first = false;
        out += string_repr(k) + ": " + to_repr(v);
      }
      return out + "}";
    }
    case Value::Kind::ns: {
      std::string out = "<Namespace {";
      bool first = true;
      for (const auto& [k, v] : value.namespace_data().entries) {
        if (!first) out += ", ";
        first = false;
        out += string_repr(k) + ": " + to_repr(v);
      }
      return out + "}>";
    }
    case Value::Kind::undefined:
      return "Undefined";
    default:
      return to_str(value);
  }
}

TrackedText to_tracked_str(const Value& value) {
  if (value.is_string()) return TrackedText{value.as_string(), value.untrusted_ranges()};
  TrackedText out{to_str(value), {}};
  if (holds_untrusted(value)) add_range(out.untrusted, 0, out.text.size());
  return out;
}

bool holds_untrusted(const Value& value) {
  auto object_holds = [](const ObjectData& data) {
    if (data.untrusted_keys && !data.entries.empty()) return true;
    for (const auto& [k, v] : data.entries) {
      if (holds_untrusted(v)) return true;
    }
    return false;
  };
  switch (value.kind()) {
    case Value::Kind::string:
      return !value.untrusted_ranges().empty();
    case Value::Kind::array:
      for (const Value& item : value.as_array().items) {
        if (holds_untrusted(item)) return true;
      }
      return false;
    case Value::Kind::object:
      return object_holds(value.as_object());
    case Value::Kind::ns:
      return object_holds(value.namespace_data());
    default:
      return false;
  }
}

Value mark_untrusted(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::string:
      return Value::untrusted_string(value.as_string());
    case Value::Kind::array: {
      std::vector<Value> items;
      items.reserve(value.as_array().items.size());
      for (const Value& item : value.as_array().items) items.push_back(mark_untrusted(item));
      return Value::array(std::move(items), value.as_array().is_tuple);
    }
    case Value::Kind::object: {
      ObjectData data;
      data.untrusted_keys = true;
      data.entries.reserve(value.as_object().entries.size());
      for (const auto& [k, v] : value.as_object().entries)
        data.entries.emplace_back(k, mark_untrusted(v));
      return Value::object(std::move(data));
    }
    default:  // a namespace is shared by reference and only ever holds what was assigned to it
      return value;
  }
}

std::string to_str(const Value& value) {
  switch (value.kind()) {
    case Value::Kind::undefined:
      return "";
    case Value::Kind::none:
      return "None";
    case Value::Kind::boolean:
      return value.as_bool() ? "True" : "False";
    case Value::Kind::integer:
      return std::to_string(value.as_int());
    case Value::Kind::floating:
      return float_repr(value.as_float());
    case Value::Kind::string:
      return value.as_string();
    case Value::Kind::loop:
      return cat("<LoopContext ", value.as_loop().index0 + 1, "/", value.as_loop().items->size(),
                 ">");
    case Value::Kind::callable:
      return cat("<function ", value.as_callable().name, ">");
    default:
      return to_repr(value);
  }
}

// ---- JSON text (Python json.dumps) --------------------------------------------------------------

namespace {

void append_json_string(std::string& out, std::string_view text, bool ensure_ascii) {
  out += '"';
  for (size_t pos = 0; pos < text.size();) {
    const Utf8Step step = utf8_step(text, pos);
    const auto byte = static_cast<uint8_t>(text[pos]);
    char hex[16];
    if (byte < 0x80) {
      switch (byte) {
        case '"':
          out += "\\\"";
          break;
        case '\\':
          out += "\\\\";
          break;
        case '\n':
          out += "\\n";
          break;
        case '\r':
          out += "\\r";
          break;
        case '\t':
          out += "\\t";
          break;
        case '\b':
          out += "\\b";
          break;
        case '\f':
          out += "\\f";
          break;
        default:
          if (byte < 0x20 || (ensure_ascii && byte == 0x7F)) {
            std::snprintf(hex, sizeof(hex), "\\u%04x", static_cast<unsigned>(byte));
            out += hex;
          } else {
            out += static_cast<char>(byte);
          }
      }
    } else if (!ensure_ascii || !step.valid) {
      out.append(text.substr(pos, step.length));
    } else {
      char32_t cp = utf8_decode(text, pos, step.length);
      if (cp >= 0x10000) {
        cp -= 0x10000;
        std::snprintf(hex, sizeof(hex), "\\u%04x\\u%04x",
                      static_cast<unsigned>(0xD800 + (cp >> 10)),
                      static_cast<unsigned>(0xDC00 + (cp & 0x3FF)));
      } else {
        std::snprintf(hex, sizeof(hex), "\\u%04x", static_cast<unsigned>(cp));
      }
      out += hex;
    }
    pos += step.length;
  }
  out += '"';
}

void append_json(std::string& out, const Value& value, const JsonFormat& format, size_t level) {
  const std::string item_separator =
      format.item_separator ? *format.item_separator : (format.indent ? "," : ", ");
  const std::string key_separator = format.key_separator ? *format.key_separator : ": ";
  auto newline = [&](size_t depth) {
    if (!format.indent) return;
    out += '\n';
    for (size_t i = 0; i < depth; ++i) out += *format.indent;
  };
  switch (value.kind()) {
    case Value::Kind::none:
      out += "null";
      return;
    case Value::Kind::boolean:
      out += value.as_bool() ? "true" : "false";
      return;
    case Value::Kind::integer:
      out += std::to_string(value.as_int());
      return;
    case Value::Kind::floating: {
      const double v = value.as_float();
      if (std::isnan(v)) {
        out += "NaN";
      } else if (std::isinf(v)) {
        out += v > 0 ? "Infinity" : "-Infinity";
      } else {
        out += float_repr(v);
      }
      return;
    }
    case Value::Kind::string:
      append_json_string(out, value.as_string(), format.ensure_ascii);
      return;
    case Value::Kind::array: {
      const auto& items = value.as_array().items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += item_separator;
        newline(level + 1);
        append_json(out, items[i], format, level + 1);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::Kind::object: {
      const auto& entries = value.as_object().entries;
      if (entries.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> order;
      for (const auto& entry : entries) order.push_back(&entry);
      if (format.sort_keys) {
        std::stable_sort(order.begin(), order.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      out += '{';
      for (size_t i = 0; i < order.size(); ++i) {
        if (i > 0) out += item_separator;
        newline(level + 1);
        append_json_string(out, order[i]->first, format.ensure_ascii);
        out += key_separator;
        append_json(out, order[i]->second, format, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    default:
      fail(0, cat("Object of type ", value.type_name(), " is not JSON serializable"));
  }
}

}  // namespace

std::string to_json_text(const Value& value, const JsonFormat& format) {
  std::string out;
  append_json(out, value, format, 0);
  return out;
}

// ---- Comparison ---------------------------------------------------------------------------------

bool values_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_int() && b.is_int()) return a.as_int() == b.as_int();
    return a.as_number() == b.as_number();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::undefined:
    case Value::Kind::none:
      return true;
    case Value::Kind::string:
      return a.as_string() == b.as_string();
    case Value::Kind::array: {
      const auto& x = a.as_array().items;
      const auto& y = b.as_array().items;
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!values_equal(x[i], y[i])) return false;
      }
      return true;
    }
    case Value::Kind::object: {
      const auto& x = a.as_object();
      const auto& y = b.as_object();
      if (x.entries.size() != y.entries.size()) return false;
      for (const auto& [k, v] : x.entries) {
        const Value* other = y.find(k);
        if (other == nullptr || !values_equal(v, *other)) return false;
      }
      return true;
    }
    case Value::Kind::ns:
      return &a.namespace_data() == &b.namespace_data();
    case Value::Kind::callable:
      return &a.as_callable() == &b.as_callable();
    default:
      return false;
  }
}

int compare_values(const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number()) {
    if (a.is_int() && b.is_int()) return a.as_int() < b.as_int() ? -1 : (a.as_int() > b.as_int());
    const double x = a.as_number();
    const double y = b.as_number();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    const int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_array() && b.is_array()) {
    const auto& x = a.as_array().items;
    const auto& y = b.as_array().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!values_equal(x[i], y[i])) return compare_values(x[i], y[i], line);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  fail(line, cat("'<' not supported between instances of '", a.type_name(), "' and '",
                 b.type_name(), "'"));
}

}  // namespace e4kv::jinja
