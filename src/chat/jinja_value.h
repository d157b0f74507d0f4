// The values a chat template computes with, modelled on what Python's Jinja2 sees when transformers
// renders a chat template: None, bool, int, float, str (UTF-8), list (and tuple), dict (insertion
// ordered, string keys), Jinja2's namespace, the loop object, callables (macros, builtins, bound
// methods) and Jinja2's default Undefined. Lists and dicts are immutable once built (transformers
// renders in an immutable sandbox), so they are shared, not copied; a namespace is the one mutable
// object and is shared by reference, as in Python.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/json.h"

namespace e4kv::jinja {

// An error raised while lexing, parsing or rendering: the 1-based template line (0 when unknown)
// and the reason. Internal to the engine; the public API turns it into a Status.
struct TemplateError {
  int line = 0;
  std::string message;
};

[[noreturn]] void fail(int line, std::string message);

class Value;
class Interpreter;

// Byte ranges [begin, end) of a string that came from the caller's data (message content, tool
// definitions, any string of the render context that is not the checkpoint's own) rather than from
// the template. Sorted, disjoint and not touching. The tokenizer matches control tokens only
// outside them, so text a user wrote cannot become a role boundary.
using ByteRanges = std::vector<std::pair<size_t, size_t>>;

// Text with the ranges in it that came from the caller's data.
struct TrackedText {
  std::string text;
  ByteRanges untrusted;

  void append(std::string_view more, const ByteRanges& more_untrusted = {});
  void append(const TrackedText& more) { append(more.text, more.untrusted); }
};

// Adds [begin, end) to `ranges` (kept sorted, disjoint, not touching); empty ranges are ignored.
void add_range(ByteRanges& ranges, size_t begin, size_t end);
// The part of `ranges` inside [begin, end), shifted to start at 0.
ByteRanges slice_ranges(const ByteRanges& ranges, size_t begin, size_t end);
// Whether [begin, end) overlaps one of `ranges`.
bool overlaps(const ByteRanges& ranges, size_t begin, size_t end);

struct ArrayData {
  std::vector<Value> items;
  bool is_tuple = false;  // printed as (a, b) instead of [a, b]
};

struct ObjectData {
  std::vector<std::pair<std::string, Value>> entries;  // insertion order
  bool untrusted_keys = false;  // the keys came from the caller's data (see ByteRanges)
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(std::string key, Value value);
};

// The positional and keyword arguments of one call.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  int line = 0;

  const Value* keyword_arg(std::string_view name) const;
  // Argument `index` by position, else by keyword `name`; nullptr when absent.
  const Value* get(size_t index, std::string_view name) const;
  // Refuses more than `max_positional` positional arguments or a keyword outside `names`.
  void expect(std::string_view what, size_t max_positional,
              std::initializer_list<std::string_view> names) const;
};

struct Callable {
  std::string name;
  std::function<Value(Interpreter&, const CallArgs&)> call;
};

// The `loop` variable of one iteration of a for loop.
struct LoopData {
  size_t index0 = 0;
  std::shared_ptr<const std::vector<Value>> items;
};

class Value {
 public:
  enum class Kind {
    undefined,
    none,
    boolean,
    integer,
    floating,
    string,
    array,
    object,
    ns,
    loop,
    callable
  };

  Value() = default;  // undefined
  static Value undefined(std::string name = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value floating(double v);
  static Value string(std::string v, ByteRanges untrusted = {});
  // A string that came entirely from the caller's data.
  static Value untrusted_string(std::string v);
  static Value array(std::vector<Value> items, bool is_tuple = false);
  static Value object(ObjectData data);
  static Value make_namespace(ObjectData data);
  static Value loop(LoopData data);
  static Value callable(std::string name, std::function<Value(Interpreter&, const CallArgs&)> call);

  // JSON in: null, bool, integer (unsigned above int64 becomes a float), float, string, array,
  // object (order kept). Refuses nesting deeper than kMaxJsonDepth. `untrusted`: the strings and
  // keys are the caller's data (see ByteRanges).
  static constexpr int kMaxJsonDepth = ::e4kv::kMaxJsonDepth;
  static Value from_json(const nlohmann::ordered_json& json, bool untrusted = false, int depth = 0);
  // JSON out; refuses undefined, namespaces, loops and callables (throws TemplateError, line 0).
  nlohmann::ordered_json to_json() const;

  Kind kind() const { return static_cast<Kind>(data_.index()); }
  bool is_undefined() const { return kind() == Kind::undefined; }
  bool is_none() const { return kind() == Kind::none; }
  bool is_bool() const { return kind() == Kind::boolean; }
  bool is_int() const { return kind() == Kind::integer; }
  bool is_float() const { return kind() == Kind::floating; }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return kind() == Kind::string; }
  bool is_array() const { return kind() == Kind::array; }
  bool is_object() const { return kind() == Kind::object; }
  bool is_namespace() const { return kind() == Kind::ns; }
  bool is_loop() const { return kind() == Kind::loop; }
  bool is_callable() const { return kind() == Kind::callable; }

  bool as_bool() const { return std::get<bool>(data_); }
  int64_t as_int() const { return std::get<int64_t>(data_); }
  double as_float() const { return std::get<double>(data_); }
  // int, float or bool as a double.
  double as_number() const;
  const std::string& as_string() const { return std::get<StringData>(data_).text; }
  // The caller's-data ranges of a string (see ByteRanges).
  const ByteRanges& untrusted_ranges() const { return std::get<StringData>(data_).untrusted; }
  const ArrayData& as_array() const { return *std::get<std::shared_ptr<const ArrayData>>(data_); }
  const ObjectData& as_object() const {
    return *std::get<std::shared_ptr<const ObjectData>>(data_);
  }
  ObjectData& namespace_data() const { return *std::get<Namespace>(data_).data; }
  const LoopData& as_loop() const { return std::get<LoopData>(data_); }
  const Callable& as_callable() const { return *std::get<std::shared_ptr<const Callable>>(data_); }
  // The variable name an undefined value came from ("" when unknown), for messages.
  const std::string& undefined_name() const { return std::get<Undefined>(data_).name; }

  // Python truthiness.
  bool truthy() const;
  // Python's type name, for messages: "str", "int", "list", "dict", "Undefined" ...
  std::string type_name() const;

 private:
  struct Undefined {
    std::string name;
  };
  struct None {};
  struct StringData {
    std::string text;
    ByteRanges untrusted;
  };
  struct Namespace {
    std::shared_ptr<ObjectData> data;
  };
  using Data = std::variant<Undefined, None, bool, int64_t, double, StringData,
                            std::shared_ptr<const ArrayData>, std::shared_ptr<const ObjectData>,
                            Namespace, LoopData, std::shared_ptr<const Callable>>;
  explicit Value(Data data) : data_(std::move(data)) {}
  Data data_;
};

// Python's str(): what `{{ value }}` prints ("" for undefined, "None", "True", repr of a list).
std::string to_str(const Value& value);
// Python's repr().
std::string to_repr(const Value& value);
// to_str() with its caller's-data ranges: a string's own; for any other value, all of it when the
// value holds any of the caller's data (a list or dict printed whole), else none.
TrackedText to_tracked_str(const Value& value);
// Whether `value` is or holds (in list items, dict keys or values, namespace attributes) a string
// with caller's-data ranges.
bool holds_untrusted(const Value& value);
// `value` with every string in it (dict keys included) marked as the caller's data throughout:
// what a builtin returns when it computed the result from the caller's data in a way that does
// not keep track of which characters came from where.
Value mark_untrusted(const Value& value);
// Python's repr() of a float: the shortest string that reads back the same, "1.0", "1e+16".
std::string float_repr(double value);

struct JsonFormat {
  std::optional<std::string> indent;  // unset: one line
  std::optional<std::string> item_separator;
  std::optional<std::string> key_separator;
  bool ensure_ascii = false;
  bool sort_keys = false;
};
// Python's json.dumps as transformers' `tojson` filter calls it (ensure_ascii=False by default).
std::string to_json_text(const Value& value, const JsonFormat& format);

// Python ==, and the ordering of <, sorted() (numbers with numbers, strings with strings, lists
// element-wise); a comparison Python refuses throws TemplateError.
bool values_equal(const Value& a, const Value& b);
int compare_values(const Value& a, const Value& b, int line);

// Python's str.isspace() for the code points that occur in practice (ASCII whitespace, the
// separators \x1c-\x1f, NEL, NBSP and the Unicode space characters).
bool is_python_space(char32_t cp);

// The number of code points of a UTF-8 string, and the code points themselves.
size_t utf8_length(std::string_view text);
std::vector<std::string_view> utf8_chars(std::string_view text);

}  // namespace e4kv::jinja
