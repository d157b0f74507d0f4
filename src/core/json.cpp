#include "core/json.h"

#include <utility>

namespace e4kv {
namespace {

// Thrown from the parser callback to stop the parse; caught in parse_with_limits.
struct StopParse {
  Status status;
};

template <class Json>
Result<Json> parse_with_limits(std::string_view text, std::string_view source,
                               const JsonLimits& limits, const JsonEventCheck<Json>& check) {
  using Event = typename Json::parse_event_t;
  // nlohmann calls this before it opens each container, with the number of containers already
  // open, so a deep input stops at level max_depth + 1 and nothing ever holds more.
  auto callback = [&](int depth, Event event, Json& parsed) -> bool {
    if ((event == Event::array_start || event == Event::object_start) &&
        depth >= limits.max_depth) {
      throw StopParse{Status::error(cat(source, ": JSON nests deeper than ", limits.max_depth,
                                        " levels of arrays and objects (the most e4kv reads); "
                                        "is this the right file?"))};
    }
    if (check) {
      if (Status status = check(depth, event, parsed); !status.ok()) {
        throw StopParse{std::move(status)};
      }
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const StopParse& stop) {
    return stop.status;
  } catch (const typename Json::parse_error& e) {
    return Status::error(
        cat(source, ": invalid JSON at byte ", e.byte, ": ", json_exception_reason(e)));
  } catch (const typename Json::exception& e) {
    // e.g. out_of_range.406 "number overflow parsing '1e400'"
    return Status::error(cat(source, ": invalid JSON: ", json_exception_reason(e)));
  }
}

// Levels of containers an excerpt opens; deeper ones read "[...]" / "{...}".
constexpr int kExcerptLevels = 3;

// `text` cut to at most `max_bytes` bytes without splitting a UTF-8 sequence.
std::string_view utf8_prefix(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t end = max_bytes;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  return text.substr(0, end);
}

// Appends `value` to `out` until `out` holds more than `budget` bytes; the caller cuts the rest.
template <class Json>
void append_excerpt(const Json& value, int levels_left, size_t budget, std::string& out) {
  if (out.size() > budget) return;
  if (value.is_string()) {
    const auto& text = value.template get_ref<const std::string&>();
    const std::string_view head = utf8_prefix(text, budget - out.size() + 1);
    out += Json(std::string(head)).dump(-1, ' ', false, Json::error_handler_t::replace);
    if (head.size() < text.size()) out.insert(out.size() - 1, "...");
    return;
  }
  if (!value.is_structured()) {
    out += value.dump(-1, ' ', false, Json::error_handler_t::replace);
    return;
  }
  const bool is_object = value.is_object();
  if (value.empty()) {
    out += is_object ? "{}" : "[]";
    return;
  }
  if (levels_left == 0) {
    out += is_object ? "{...}" : "[...]";
    return;
  }
  out += is_object ? '{' : '[';
  bool first = true;
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (out.size() > budget) return;
    if (!first) out += ',';
    first = false;
    if (is_object) {
      out += Json(std::string(utf8_prefix(it.key(), budget)))
                 .dump(-1, ' ', false, Json::error_handler_t::replace);
      out += ':';
    }
    append_excerpt(it.value(), levels_left - 1, budget, out);
  }
  out += is_object ? '}' : ']';
}

template <class Json>
std::string excerpt(const Json& value, size_t max_chars) {
  std::string out;
  append_excerpt(value, kExcerptLevels, max_chars, out);
  if (out.size() <= max_chars) return out;
  constexpr std::string_view kEllipsis = "...";
  const size_t keep = max_chars > kEllipsis.size() ? max_chars - kEllipsis.size() : 0;
  return cat(utf8_prefix(out, keep), kEllipsis);
}

}  // namespace

Result<nlohmann::json> parse_json(std::string_view text, std::string_view source,
                                  const JsonLimits& limits,
                                  const JsonEventCheck<nlohmann::json>& check) {
  return parse_with_limits<nlohmann::json>(text, source, limits, check);
}

Result<nlohmann::ordered_json> parse_ordered_json(
    std::string_view text, std::string_view source, const JsonLimits& limits,
    const JsonEventCheck<nlohmann::ordered_json>& check) {
  return parse_with_limits<nlohmann::ordered_json>(text, source, limits, check);
}

std::string json_excerpt(const nlohmann::json& value, size_t max_chars) {
  return excerpt(value, max_chars);
}

std::string json_excerpt(const nlohmann::ordered_json& value, size_t max_chars) {
  return excerpt(value, max_chars);
}

}  // namespace e4kv
