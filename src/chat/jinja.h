// A Jinja2 template engine for the chat templates of Hugging Face checkpoints.
//
// It implements the part of Jinja2 that chat templates use, with the semantics transformers gives
// them (Python Jinja2 3.x, ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks, the
// loopcontrols extension, transformers' tojson and its raise_exception / strftime_now globals):
//   - tags: if/elif/else, for (tuple targets, `if` filter, else, loop.index/index0/revindex/
//     revindex0/first/last/length/previtem/nextitem/cycle), set (with tuple targets, namespace
//     attributes and the block form), macro (defaults, keyword arguments), filter blocks, break,
//     continue, raw, comments, whitespace control, and transformers' {% generation %};
//   - expressions: literals (incl. lists, dicts, tuples), and or not in is, `not in`, `is not`,
//     comparisons, + - * / // % ** ~, slicing a[b:c:d], subscripts, attributes, calls,
//     `a if c else b`;
//   - the filters, tests, str/dict/list methods and globals listed in jinja_builtins.cpp;
//   - values as Python sees them: None prints "None", True "True", a list `['a', 1]`, floats as
//     Python's repr; string lengths, indexes and slices count code points.
// Undefined follows Jinja2's default Undefined (prints as "", is false, iterates as empty, fails
// when called, compared with <, or used in arithmetic), except that an attribute or item of an
// undefined value is undefined rather than an error.
// Not implemented, each refused with an error naming it: {% call %}, include/import/extends/
// block, recursive loops, macros' caller/varargs/kwargs, printf-style `%` on strings, filters and
// tests outside the list. Case mapping (upper, lower, title, capitalize) maps ASCII letters only.
//
// Every error names the template line: "chat template line 12: unsupported filter 'wordwrap'".
// Unknown tags, filters and tests are refused when the template is parsed, as Jinja2 refuses them
// when it compiles one. Rendering is bounded (RenderLimits): output size, macro call depth and
// loop iterations, so a runaway template ends with an error instead of exhausting memory.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "chat/jinja_interpreter.h"
#include "core/status.h"

namespace e4kv {

using JinjaLimits = jinja::RenderLimits;

class JinjaTemplate {
 public:
  // `what` starts every error message ("chat template" gives "chat template line 3: ...").
  static Result<JinjaTemplate> parse(std::string_view source, std::string what = "chat template");

  // Renders with the members of `context` (a JSON object) as the template's variables.
  Result<std::string> render(const nlohmann::ordered_json& context,
                             const JinjaLimits& limits = {}) const;
  // Renders with the members of `trusted` and `untrusted` (JSON objects, no name in both) as the
  // variables, and tells which bytes of the text came from the strings of `untrusted` (see
  // jinja::ByteRanges; jinja_interpreter.h says how they are carried through the template).
  Result<jinja::TrackedText> render_tracked(const nlohmann::ordered_json& trusted,
                                            const nlohmann::ordered_json& untrusted,
                                            const JinjaLimits& limits = {}) const;

 private:
  JinjaTemplate(std::shared_ptr<const jinja::Program> program, std::string what)
      : program_(std::move(program)), what_(std::move(what)) {}

  std::shared_ptr<const jinja::Program> program_;
  std::string what_;
};

}  // namespace e4kv
