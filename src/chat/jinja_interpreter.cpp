#include "chat/jinja_interpreter.h"

#include <cmath>
#include <limits>

#include "core/status.h"

namespace e4kv::jinja {

// ---- Scopes -------------------------------------------------------------------------------------

const Value* Scope::lookup(std::string_view name) const {
  for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
    for (const auto& [k, v] : s->vars) {
      if (k == name) return &v;
    }
  }
  return nullptr;
}

void Scope::set(std::string_view name, Value value) {
  for (auto& [k, v] : vars) {
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  vars.emplace_back(std::string(name), std::move(value));
}

void fail_undefined(const Value& value, int line) {
  const std::string& name = value.undefined_name();
  fail(line, name.empty() ? "a value is undefined" : cat("'", name, "' is undefined"));
}

void Interpreter::check_size(size_t bytes, int line) const {
  if (bytes > limits_.max_output_bytes) {
    fail(line, cat("the rendered text exceeds the output limit of ", limits_.max_output_bytes,
                   " bytes (a runaway template?)"));
  }
}

void Interpreter::append(TrackedText& out, const TrackedText& text, int line) const {
  check_size(out.text.size() + text.text.size(), line);
  out.append(text);
}

bool args_hold_untrusted(const CallArgs& args) {
  for (const Value& v : args.positional) {
    if (holds_untrusted(v)) return true;
  }
  for (const auto& [k, v] : args.keyword) {
    if (holds_untrusted(v)) return true;
  }
  return false;
}

Value track_builtin_result(Value result, bool inputs_untrusted, bool tracked) {
  if (!inputs_untrusted || tracked) return result;
  return mark_untrusted(result);
}

// ---- Statements ---------------------------------------------------------------------------------

TrackedText Interpreter::render(const Program& program, const ObjectData& context) {
  auto globals = std::make_shared<Scope>();
  add_globals(*globals);
  auto variables = std::make_shared<Scope>();
  variables->parent = globals;
  for (const auto& [k, v] : context.entries) variables->set(k, v);
  auto root = std::make_shared<Scope>();
  root->parent = variables;
  TrackedText out;
  render_body(program.body, root, out);
  return out;
}

Interpreter::Flow Interpreter::render_body(const Body& body, const ScopePtr& scope,
                                           TrackedText& out) {
  for (const Node& node : body) {
    const Flow flow = render_node(node, scope, out);
    if (flow != Flow::normal) return flow;
  }
  return Flow::normal;
}

Interpreter::Flow Interpreter::render_node(const Node& node, const ScopePtr& scope,
                                           TrackedText& out) {
  switch (node.kind) {
    case Node::Kind::text:
      append(out, TrackedText{node.text, {}}, node.line);
      return Flow::normal;
    case Node::Kind::output:
      append(out, to_tracked_str(eval(*node.expr, scope)), node.line);
      return Flow::normal;
    case Node::Kind::if_:
      return render_body(eval(*node.expr, scope).truthy() ? node.body : node.else_body, scope, out);
    case Node::Kind::for_:
      render_for(node, scope, out);
      return Flow::normal;
    case Node::Kind::set:
      assign(*node.target, eval(*node.expr, scope), scope, node.line);
      return Flow::normal;
    case Node::Kind::set_block: {
      TrackedText text;
      render_body(node.body, scope, text);
      Value value = Value::string(std::move(text.text), std::move(text.untrusted));
      if (node.expr) value = eval_filter(*node.expr, scope, &value);
      assign(*node.target, std::move(value), scope, node.line);
      return Flow::normal;
    }
    case Node::Kind::macro:
      scope->set(node.name, define_macro(node, scope));
      return Flow::normal;
    case Node::Kind::filter_block: {
      TrackedText text;
      const Flow flow = render_body(node.body, scope, text);
      const Value body_value = Value::string(std::move(text.text), std::move(text.untrusted));
      append(out, to_tracked_str(eval_filter(*node.expr, scope, &body_value)), node.line);
      return flow;
    }
    case Node::Kind::break_:
      return Flow::break_loop;
    case Node::Kind::continue_:
      return Flow::continue_loop;
  }
  return Flow::normal;
}

void Interpreter::render_for(const Node& node, const ScopePtr& scope, TrackedText& out) {
  const Value iterable = eval(*node.expr, scope);
  // As in Jinja2, each iteration starts from a fresh scope: what the body assigns is gone at the
  // next iteration and after the loop.
  auto bind = [&](const Value& item) {
    auto frame = std::make_shared<Scope>();
    frame->parent = scope;
    if (node.targets.size() == 1) {
      frame->set(node.targets[0], item);
      return frame;
    }
    if (!item.is_array()) {
      fail(node.line, cat("cannot unpack a ", item.type_name(), " into ", node.targets.size(),
                          " loop variables"));
    }
    const auto& parts = item.as_array().items;
    if (parts.size() != node.targets.size()) {
      fail(node.line,
           cat(parts.size() > node.targets.size() ? "too many" : "not enough",
               " values to unpack (expected ", node.targets.size(), ", got ", parts.size(), ")"));
    }
    for (size_t i = 0; i < parts.size(); ++i) frame->set(node.targets[i], parts[i]);
    return frame;
  };
  std::vector<Value> candidates = iterate(iterable, node.line);
  auto items = std::make_shared<std::vector<Value>>();
  if (node.filter) {
    for (Value& item : candidates) {
      if (eval(*node.filter, bind(item)).truthy()) items->push_back(std::move(item));
    }
  } else {
    *items = std::move(candidates);
  }
  const std::shared_ptr<const std::vector<Value>> shared_items = items;
  for (size_t i = 0; i < shared_items->size(); ++i) {
    if (++loop_iterations_ > limits_.max_loop_iterations) {
      fail(node.line, cat("the template ran more than ", limits_.max_loop_iterations,
                          " loop iterations (a runaway template?)"));
    }
    const ScopePtr frame = bind((*shared_items)[i]);
    frame->set("loop", Value::loop(LoopData{i, shared_items}));
    if (render_body(node.body, frame, out) == Flow::break_loop) break;
  }
  if (shared_items->empty() && !node.else_body.empty()) {
    auto frame = std::make_shared<Scope>();
    frame->parent = scope;
    render_body(node.else_body, frame, out);
  }
}

void Interpreter::assign(const Expr& target, Value value, const ScopePtr& scope, int line) {
  switch (target.kind) {
    case Expr::Kind::name:
      scope->set(target.name, std::move(value));
      return;
    case Expr::Kind::tuple: {
      if (!value.is_array()) {
        fail(line,
             cat("cannot unpack a ", value.type_name(), " into ", target.items.size(), " names"));
      }
      const auto& parts = value.as_array().items;
      if (parts.size() != target.items.size()) {
        fail(line,
             cat(parts.size() > target.items.size() ? "too many" : "not enough",
                 " values to unpack (expected ", target.items.size(), ", got ", parts.size(), ")"));
      }
      for (size_t i = 0; i < parts.size(); ++i) scope->set(target.items[i]->name, parts[i]);
      return;
    }
    case Expr::Kind::getattr: {
      const Value object = eval(*target.a, scope);
      if (!object.is_namespace()) {
        fail(line, cat("cannot assign the attribute '", target.name, "' of a ", object.type_name(),
                       " (only a namespace() takes attribute assignments)"));
      }
      object.namespace_data().set(target.name, std::move(value));
      return;
    }
    default:
      fail(line, "unsupported assignment target");
  }
}

Value Interpreter::define_macro(const Node& node, const ScopePtr& scope) {
  const Node* macro = &node;
  // The macro value lives in `scope`: a strong reference back to it would be a cycle that outlives
  // the render. The interpreter keeps defining scopes alive until the render ends instead.
  macro_scopes_.push_back(scope);
  std::weak_ptr<Scope> defining_scope = scope;
  return Value::callable(node.name, [macro, defining_scope](Interpreter& in, const CallArgs& args) {
    if (++in.call_depth_ > in.limits_.max_call_depth) {
      fail(args.line, cat("macro calls nest deeper than ", in.limits_.max_call_depth,
                          " (runaway recursion?)"));
    }
    ScopePtr closure = defining_scope.lock();
    E4KV_ASSERT(closure != nullptr, "a macro outlived the render that defined it");
    auto frame = std::make_shared<Scope>();
    frame->parent = closure;
    const auto& params = macro->params;
    if (args.positional.size() > params.size()) {
      fail(args.line,
           cat("macro '", macro->name, "' takes not more than ", params.size(), " argument(s)"));
    }
    std::vector<bool> bound(params.size(), false);
    for (size_t i = 0; i < args.positional.size(); ++i) {
      frame->set(params[i], args.positional[i]);
      bound[i] = true;
    }
    for (const auto& [key, value] : args.keyword) {
      size_t i = 0;
      while (i < params.size() && params[i] != key) ++i;
      if (i == params.size()) {
        fail(args.line, cat("macro '", macro->name, "' takes no keyword argument '", key, "'"));
      }
      if (bound[i]) {
        fail(args.line,
             cat("macro '", macro->name, "' got multiple values for argument '", key, "'"));
      }
      frame->set(key, value);
      bound[i] = true;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (bound[i]) continue;
      frame->set(params[i], macro->defaults[i] ? in.eval(*macro->defaults[i], frame)
                                               : Value::undefined(params[i]));
    }
    TrackedText text;
    in.render_body(macro->body, frame, text);
    --in.call_depth_;
    return Value::string(std::move(text.text), std::move(text.untrusted));
  });
}

// ---- Expressions --------------------------------------------------------------------------------

CallArgs Interpreter::eval_args(const Expr& expr, const ScopePtr& scope) {
  CallArgs args;
  args.line = expr.line;
  args.positional.reserve(expr.items.size());
  for (const ExprPtr& item : expr.items) args.positional.push_back(eval(*item, scope));
  for (const auto& [key, item] : expr.kwargs) args.keyword.emplace_back(key, eval(*item, scope));
  return args;
}

Value Interpreter::eval_filter(const Expr& expr, const ScopePtr& scope,
                               const Value* block_operand) {
  // A filter block's chain starts from the rendered body (an innermost operand of null).
  const Value operand = !expr.a ? *block_operand
                        : expr.a->kind == Expr::Kind::filter
                            ? eval_filter(*expr.a, scope, block_operand)
                            : eval(*expr.a, scope);
  return apply_tracked_filter(expr.name, operand, eval_args(expr, scope));
}

Value Interpreter::call(const Expr& expr, const ScopePtr& scope) {
  const Value callee = eval(*expr.a, scope);
  if (callee.is_callable()) {
    const CallArgs args = eval_args(expr, scope);
    return callee.as_callable().call(*this, args);
  }
  if (expr.a->kind == Expr::Kind::getattr) {
    const Value object = eval(*expr.a->a, scope);
    if (object.is_string() || object.is_array() || object.is_object()) {
      fail(expr.line, cat("unsupported method '", object.is_string() ? "str" : object.type_name(),
                          ".", expr.a->name, "'"));
    }
  }
  if (callee.is_undefined()) fail_undefined(callee, expr.line);
  fail(expr.line, cat("'", callee.type_name(), "' object is not callable"));
}

Value Interpreter::eval(const Expr& expr, const ScopePtr& scope) {
  switch (expr.kind) {
    case Expr::Kind::literal:
      return expr.value;
    case Expr::Kind::name: {
      const Value* value = scope->lookup(expr.name);
      return value != nullptr ? *value : Value::undefined(expr.name);
    }
    case Expr::Kind::list:
    case Expr::Kind::tuple: {
      std::vector<Value> items;
      items.reserve(expr.items.size());
      for (const ExprPtr& item : expr.items) items.push_back(eval(*item, scope));
      return Value::array(std::move(items), expr.kind == Expr::Kind::tuple);
    }
    case Expr::Kind::dict: {
      ObjectData data;
      for (size_t i = 0; i + 1 < expr.items.size(); i += 2) {
        const Value key = eval(*expr.items[i], scope);
        if (!key.is_string()) {
          fail(expr.line, cat("unsupported dict key of type ", key.type_name(),
                              " (only string keys are supported)"));
        }
        if (!key.untrusted_ranges().empty()) data.untrusted_keys = true;
        data.set(key.as_string(), eval(*expr.items[i + 1], scope));
      }
      return Value::object(std::move(data));
    }
    case Expr::Kind::unary: {
      const Value operand = eval(*expr.a, scope);
      if (expr.name == "not") return Value::boolean(!operand.truthy());
      if (operand.is_undefined()) fail_undefined(operand, expr.line);
      if (operand.is_float()) {
        return Value::floating(expr.name == "-" ? -operand.as_float() : operand.as_float());
      }
      if (operand.is_int() || operand.is_bool()) {
        const int64_t v = operand.is_int() ? operand.as_int() : (operand.as_bool() ? 1 : 0);
        if (expr.name == "+") return Value::integer(v);
        if (v == std::numeric_limits<int64_t>::min()) fail(expr.line, "integer overflow");
        return Value::integer(-v);
      }
      fail(expr.line,
           cat("bad operand type for unary ", expr.name, ": '", operand.type_name(), "'"));
    }
    case Expr::Kind::binary:
      return eval_binary(expr, scope);
    case Expr::Kind::logical: {
      Value left = eval(*expr.a, scope);
      if (expr.name == "and") return left.truthy() ? eval(*expr.b, scope) : left;
      return left.truthy() ? left : eval(*expr.b, scope);
    }
    case Expr::Kind::conditional:
      if (eval(*expr.b, scope).truthy()) return eval(*expr.a, scope);
      return expr.c ? eval(*expr.c, scope) : Value::undefined();
    case Expr::Kind::getattr:
      return get_attribute(eval(*expr.a, scope), expr.name, expr.line);
    case Expr::Kind::getitem:
      return get_item(eval(*expr.a, scope), eval(*expr.b, scope), expr.line);
    case Expr::Kind::slice: {
      const Value object = eval(*expr.a, scope);
      auto bound = [&](const ExprPtr& e) -> std::optional<int64_t> {
        if (!e) return std::nullopt;
        const Value v = eval(*e, scope);
        if (v.is_none() || v.is_undefined()) return std::nullopt;
        if (v.is_int()) return v.as_int();
        if (v.is_bool()) return v.as_bool() ? 1 : 0;
        fail(expr.line, "slice indices must be integers or None");
      };
      const std::optional<int64_t> start = bound(expr.b);
      const std::optional<int64_t> stop = bound(expr.c);
      const int64_t step = bound(expr.d).value_or(1);
      if (step == 0) fail(expr.line, "slice step cannot be zero");
      std::vector<std::string_view> chars;
      size_t length = 0;
      if (object.is_string()) {
        chars = utf8_chars(object.as_string());
        length = chars.size();
      } else if (object.is_array()) {
        length = object.as_array().items.size();
      } else if (object.is_undefined()) {
        fail_undefined(object, expr.line);
      } else {
        fail(expr.line, cat("'", object.type_name(), "' object is not subscriptable"));
      }
      // Python's slice.indices().
      const auto n = static_cast<int64_t>(length);
      auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
        if (!v) return fallback;
        int64_t x = *v < 0 ? *v + n : *v;
        if (step > 0) return std::clamp<int64_t>(x, 0, n);
        return std::clamp<int64_t>(x, -1, n - 1);
      };
      const int64_t from = clamp(start, step > 0 ? 0 : n - 1);
      const int64_t to = clamp(stop, step > 0 ? n : -1);
      std::vector<size_t> picks;
      for (int64_t i = from; step > 0 ? i < to : i > to; i += step) {
        picks.push_back(static_cast<size_t>(i));
      }
      if (object.is_string()) {
        const std::string& whole = object.as_string();
        const ByteRanges& untrusted = object.untrusted_ranges();
        TrackedText text;
        for (size_t i : picks) {
          const size_t begin = static_cast<size_t>(chars[i].data() - whole.data());
          text.append(chars[i], slice_ranges(untrusted, begin, begin + chars[i].size()));
        }
        return Value::string(std::move(text.text), std::move(text.untrusted));
      }
      std::vector<Value> items;
      items.reserve(picks.size());
      for (size_t i : picks) items.push_back(object.as_array().items[i]);
      return Value::array(std::move(items), object.as_array().is_tuple);
    }
    case Expr::Kind::call:
      return call(expr, scope);
    case Expr::Kind::filter:
      return eval_filter(expr, scope, nullptr);
    case Expr::Kind::test: {
      const Value operand = eval(*expr.a, scope);
      const bool result = apply_test(expr.name, operand, eval_args(expr, scope));
      return Value::boolean(result != expr.negated);
    }
  }
  fail(expr.line, "unsupported expression");
}

namespace {

bool add_overflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_add_overflow(a, b, out);
}
bool sub_overflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_sub_overflow(a, b, out);
}
bool mul_overflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}

int64_t as_integer(const Value& v) {
  return v.is_int() ? v.as_int() : (v.as_bool() ? 1 : 0);
}
bool is_integral(const Value& v) {
  return v.is_int() || v.is_bool();
}

}  // namespace

Value Interpreter::eval_binary(const Expr& expr, const ScopePtr& scope) {
  const std::string& op = expr.name;
  const Value left = eval(*expr.a, scope);
  const Value right = eval(*expr.b, scope);
  const int line = expr.line;
  if (op == "==") return Value::boolean(values_equal(left, right));
  if (op == "!=") return Value::boolean(!values_equal(left, right));
  if (op == "in" || op == "not in") {
    bool found = false;
    if (right.is_string()) {
      if (!left.is_string()) {
        fail(line, cat("'in <string>' requires string as left operand, not ", left.type_name()));
      }
      found = right.as_string().find(left.as_string()) != std::string::npos;
    } else if (right.is_object()) {
      found = left.is_string() && right.as_object().find(left.as_string()) != nullptr;
    } else if (right.is_array()) {
      for (const Value& item : right.as_array().items) {
        if (values_equal(item, left)) {
          found = true;
          break;
        }
      }
    } else if (!right.is_undefined()) {
      fail(line, cat("argument of type '", right.type_name(), "' is not iterable"));
    }
    return Value::boolean(found == (op == "in"));
  }
  if (op == "~") {
    TrackedText text = to_tracked_str(left);
    text.append(to_tracked_str(right));
    check_size(text.text.size(), line);
    return Value::string(std::move(text.text), std::move(text.untrusted));
  }
  if (left.is_undefined()) fail_undefined(left, line);
  if (right.is_undefined()) fail_undefined(right, line);
  if (op == "<" || op == "<=" || op == ">" || op == ">=") {
    const int c = compare_values(left, right, line);
    if (op == "<") return Value::boolean(c < 0);
    if (op == "<=") return Value::boolean(c <= 0);
    if (op == ">") return Value::boolean(c > 0);
    return Value::boolean(c >= 0);
  }
  auto unsupported = [&]() -> Value {
    fail(line, cat("unsupported operand type(s) for ", op, ": '", left.type_name(), "' and '",
                   right.type_name(), "'"));
  };
  if (left.is_number() && right.is_number()) {
    const bool integral = is_integral(left) && is_integral(right);
    const double x = left.as_number();
    const double y = right.as_number();
    if (op == "+" || op == "-" || op == "*") {
      if (integral) {
        int64_t result = 0;
        const bool overflow =
            op == "+"   ? add_overflows(as_integer(left), as_integer(right), &result)
            : op == "-" ? sub_overflows(as_integer(left), as_integer(right), &result)
                        : mul_overflows(as_integer(left), as_integer(right), &result);
        if (overflow) fail(line, "integer overflow");
        return Value::integer(result);
      }
      return Value::floating(op == "+" ? x + y : (op == "-" ? x - y : x * y));
    }
    if (op == "/") {
      if (y == 0) fail(line, "division by zero");
      return Value::floating(x / y);
    }
    if (op == "//" || op == "%") {
      if (y == 0) fail(line, op == "//" ? "integer division or modulo by zero" : "modulo by zero");
      if (integral) {
        const int64_t a = as_integer(left);
        const int64_t b = as_integer(right);
        if (a == std::numeric_limits<int64_t>::min() && b == -1) fail(line, "integer overflow");
        int64_t q = a / b;
        int64_t r = a % b;
        if (r != 0 && ((r < 0) != (b < 0))) {
          --q;
          r += b;
        }
        return Value::integer(op == "//" ? q : r);
      }
      const double q = std::floor(x / y);
      return Value::floating(op == "//" ? q : x - q * y);
    }
    if (op == "**") {
      if (integral && as_integer(right) >= 0) {
        int64_t result = 1;
        int64_t base = as_integer(left);
        for (int64_t e = as_integer(right); e > 0; --e) {
          if (mul_overflows(result, base, &result)) fail(line, "integer overflow");
        }
        return Value::integer(result);
      }
      if (x == 0 && y < 0) fail(line, "0.0 cannot be raised to a negative power");
      return Value::floating(std::pow(x, y));
    }
    return unsupported();
  }
  if (op == "+") {
    if (left.is_string() && right.is_string()) {
      check_size(left.as_string().size() + right.as_string().size(), line);
      TrackedText text{left.as_string(), left.untrusted_ranges()};
      text.append(right.as_string(), right.untrusted_ranges());
      return Value::string(std::move(text.text), std::move(text.untrusted));
    }
    if (left.is_array() && right.is_array()) {
      std::vector<Value> items = left.as_array().items;
      items.insert(items.end(), right.as_array().items.begin(), right.as_array().items.end());
      return Value::array(std::move(items), left.as_array().is_tuple);
    }
    if (left.is_string()) {
      fail(line, cat("can only concatenate str (not \"", right.type_name(), "\") to str"));
    }
    if (left.is_array()) {
      fail(line, cat("can only concatenate list (not \"", right.type_name(), "\") to list"));
    }
    return unsupported();
  }
  if (op == "*") {
    const Value* sequence = left.is_string() || left.is_array() ? &left : &right;
    const Value* count = sequence == &left ? &right : &left;
    if ((sequence->is_string() || sequence->is_array()) && is_integral(*count)) {
      const int64_t n = std::max<int64_t>(0, as_integer(*count));
      const size_t unit = sequence->is_string() ? sequence->as_string().size()
                                                : sequence->as_array().items.size() * sizeof(Value);
      if (unit != 0 && static_cast<uint64_t>(n) > limits_.max_output_bytes / unit) {
        check_size(limits_.max_output_bytes + 1, line);
      }
      if (sequence->is_string()) {
        TrackedText text;
        for (int64_t i = 0; i < n; ++i)
          text.append(sequence->as_string(), sequence->untrusted_ranges());
        return Value::string(std::move(text.text), std::move(text.untrusted));
      }
      std::vector<Value> items;
      for (int64_t i = 0; i < n; ++i) {
        items.insert(items.end(), sequence->as_array().items.begin(),
                     sequence->as_array().items.end());
      }
      return Value::array(std::move(items), sequence->as_array().is_tuple);
    }
    return unsupported();
  }
  if (op == "%" && left.is_string()) {
    fail(line, "unsupported operator: printf-style string formatting ('%' on a string)");
  }
  return unsupported();
}

}  // namespace e4kv::jinja
