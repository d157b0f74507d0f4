// The syntax tree of a parsed template: expressions and statements, each with its 1-based source
// line for error messages.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/jinja_value.h"

namespace e4kv::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    literal,      // value
    name,         // name
    list,         // items
    tuple,        // items
    dict,         // items: key, value, key, value ...
    unary,        // name: "-", "+" or "not"; a
    binary,       // name: the operator (+ - * / // % ** ~ == != < <= > >= in "not in"); a, b
    logical,      // name: "and" / "or"; a, b (short-circuit)
    conditional,  // a if b else c (c may be null: undefined)
    getattr,      // a.name
    getitem,      // a[b]
    slice,        // a[b:c:d], each of b c d may be null
    call,         // a(items, kwargs)
    filter,       // a | name(items, kwargs)
    test,         // a is [not] name(items)
  };

  Kind kind = Kind::literal;
  int line = 0;
  Value value;
  std::string name;
  std::vector<ExprPtr> items;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  ExprPtr a, b, c, d;
  bool negated = false;
};

struct Node;
using Body = std::vector<Node>;

struct Node {
  enum class Kind {
    text,          // text
    output,        // {{ expr }}
    if_,           // expr, body, else_body (an elif is an if_ alone in else_body)
    for_,          // targets in expr [if filter], body, else_body
    set,           // target = expr
    set_block,     // {% set target [| filters] %}body{% endset %}; expr: the filter chain or null
    macro,         // name(params = defaults), body
    filter_block,  // {% filter f %}body{% endfilter %}; expr: the filter chain over a placeholder
    break_,
    continue_,
  };

  Kind kind = Kind::text;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr target;                    // set: a name, a tuple of names or ns.attr
  std::vector<std::string> targets;  // for: the loop variable(s)
  ExprPtr filter;                    // for ... if filter
  Body body;
  Body else_body;
  std::string name;                 // macro name
  std::vector<std::string> params;  // macro parameters
  std::vector<ExprPtr> defaults;    // parallel to params; null: no default
};

struct Program {
  Body body;
};

}  // namespace e4kv::jinja
