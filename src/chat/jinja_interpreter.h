// Renders a parsed template: scopes, statements and expressions (jinja_interpreter.cpp), and the
// builtin filters, tests, methods and globals (jinja_builtins.cpp). Semantics follow Python's
// Jinja2 in transformers' ImmutableSandboxedEnvironment; see jinja.h for the documented
// differences.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "chat/jinja_ast.h"
#include "chat/jinja_value.h"

namespace e4kv::jinja {

struct RenderLimits {
  size_t max_output_bytes = size_t{64} << 20;  // the rendered text and any string built on the way
  int max_call_depth = 100;                    // nested macro calls
  uint64_t max_loop_iterations = 10'000'000;   // all for-loop iterations of one render together
};

// Variables of one scope level: the context, the template, a for loop or a macro call.
struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* lookup(std::string_view name) const;
  void set(std::string_view name, Value value);
};
using ScopePtr = std::shared_ptr<Scope>;

class Interpreter {
 public:
  explicit Interpreter(RenderLimits limits) : limits_(limits) {}

  // Renders `program` with `context` as its variables (on top of the builtin globals). The result
  // says which of its bytes came from the context's untrusted strings (see ByteRanges): text the
  // template writes itself is trusted; a string computed by a builtin from untrusted input is
  // untrusted as a whole unless the builtin keeps track (concatenation, slicing, strip, join).
  TrackedText render(const Program& program, const ObjectData& context);

  Value eval(const Expr& expr, const ScopePtr& scope);

  // Builtins (jinja_builtins.cpp).
  Value apply_filter(std::string_view name, const Value& operand, const CallArgs& args);
  bool apply_test(std::string_view name, const Value& value, const CallArgs& args);
  // Python's getattr (a dict's methods shadow its keys) and Jinja2's getitem (keys first).
  Value get_attribute(const Value& object, const std::string& name, int line);
  Value get_item(const Value& object, const Value& key, int line);
  Value call_method(const Value& receiver, const std::string& name, const CallArgs& args);
  // The builtin global functions (range, namespace, raise_exception, strftime_now, dict).
  static void add_globals(Scope& scope);

  // Refuses a string or output longer than the output limit.
  void check_size(size_t bytes, int line) const;

 private:
  enum class Flow { normal, break_loop, continue_loop };

  Flow render_body(const Body& body, const ScopePtr& scope, TrackedText& out);
  Flow render_node(const Node& node, const ScopePtr& scope, TrackedText& out);
  void render_for(const Node& node, const ScopePtr& scope, TrackedText& out);
  void assign(const Expr& target, Value value, const ScopePtr& scope, int line);
  Value define_macro(const Node& node, const ScopePtr& scope);
  Value call(const Expr& expr, const ScopePtr& scope);
  Value eval_binary(const Expr& expr, const ScopePtr& scope);
  Value eval_filter(const Expr& expr, const ScopePtr& scope, const Value* block_operand);
  CallArgs eval_args(const Expr& expr, const ScopePtr& scope);
  // Applies filter `name` and marks its result untrusted when its inputs were (see render()).
  Value apply_tracked_filter(std::string_view name, const Value& operand, const CallArgs& args);
  void append(TrackedText& out, const TrackedText& text, int line) const;

  RenderLimits limits_;
  std::vector<ScopePtr> macro_scopes_;  // scopes macros were defined in (see define_macro)
  int call_depth_ = 0;
  uint64_t loop_iterations_ = 0;
};

// Helpers shared by the interpreter and the builtins.
// Whether any argument of `args` holds untrusted strings (holds_untrusted).
bool args_hold_untrusted(const CallArgs& args);
// The result of a builtin given `inputs_untrusted` inputs: marked untrusted throughout unless the
// builtin keeps track of the ranges itself (`tracked`).
Value track_builtin_result(Value result, bool inputs_untrusted, bool tracked);
// The items a for loop or a filter walks: a list's items, a dict's keys, a string's characters,
// nothing for undefined; refuses other values.
std::vector<Value> iterate(const Value& value, int line);
// Python's str.strip/lstrip/rstrip; `chars` null strips whitespace.
std::string strip_text(std::string_view text, const std::string* chars, bool left, bool right);
std::string ascii_lower(std::string_view text);
std::string ascii_upper(std::string_view text);
// `value` raised as Jinja2 raises an undefined value's use: "'name' is undefined".
[[noreturn]] void fail_undefined(const Value& value, int line);

}  // namespace e4kv::jinja
