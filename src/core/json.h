// The one way e4kv parses JSON from outside (files, corpus lines, flags): parse_json bounds the
// nesting while nlohmann's parser runs, before anything recurses over the value. nlohmann's parser
// and destructor are iterative, but copying a value, dump() and our own conversions (the chat
// template's Value::from_json) recurse once per level, so a 100,000-deep array would overflow the
// stack long after a plain parse had accepted it. json_excerpt quotes a value in a message without
// serialising it whole.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/json_error.h"
#include "core/status.h"

namespace e4kv {

// The deepest nesting of arrays and objects any reader accepts. Real files nest a handful of
// levels (a tokenizer.json about 6); chat messages passed to a template may nest more, hence the
// room. The chat template's own conversion refuses the same figure.
inline constexpr int kMaxJsonDepth = 256;

struct JsonLimits {
  // Arrays and objects nested more than this many levels are refused; the root container is
  // level 1, a scalar adds no level ("1" nests 0, "[]" 1, "[{}]" 2).
  int max_depth = kMaxJsonDepth;
};

// Sees every parse event as nlohmann's parser callback does (depth = the containers enclosing
// the event's value or key); an error status stops the parse and becomes its result, unchanged.
template <class Json>
using JsonEventCheck =
    std::function<Status(int depth, typename Json::parse_event_t event, const Json& parsed)>;

// Parses `text` as one JSON value. Errors start with `source` (a path, or "path:line" for a line
// of a JSON-lines file): "SOURCE: invalid JSON at byte 12: parse error at line 1, column 12: ..."
// (the input is never echoed) or "SOURCE: JSON nests deeper than 256 levels ...".
Result<nlohmann::json> parse_json(std::string_view text, std::string_view source,
                                  const JsonLimits& limits = {},
                                  const JsonEventCheck<nlohmann::json>& check = {});
// The same keeping each object's key order.
Result<nlohmann::ordered_json> parse_ordered_json(
    std::string_view text, std::string_view source, const JsonLimits& limits = {},
    const JsonEventCheck<nlohmann::ordered_json>& check = {});

// `value` as compact JSON text of at most about `max_chars` characters, for an error message
// about user input: containers below the first few levels read "[...]" / "{...}", long strings
// and long containers are cut with "...". Never recurses deeper than a few levels, whatever the
// value's depth or size.
std::string json_excerpt(const nlohmann::json& value, size_t max_chars = 48);
std::string json_excerpt(const nlohmann::ordered_json& value, size_t max_chars = 48);

}  // namespace e4kv
