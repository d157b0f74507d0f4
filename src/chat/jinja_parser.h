// Parses Jinja2 syntax (the subset chat templates use) into a Program. Unknown tags, filters and
// tests are refused here, at parse time, as Jinja2 refuses unknown filters and tests when it
// compiles a template: a template that names one fails before it renders anything.
#pragma once

#include <string_view>

#include "chat/jinja_ast.h"

namespace e4kv::jinja {

inline constexpr int kMaxNesting = 200;  // nested expressions and blocks

// Throws TemplateError naming the line on a syntax error or an unsupported construct.
Program parse_template(std::string_view source);

// The filters and tests the interpreter implements (jinja_builtins.cpp).
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);

}  // namespace e4kv::jinja
