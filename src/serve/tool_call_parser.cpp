#include "serve/tool_call_parser.h"

#include <optional>
#include <random>

#include "serve/tag_scan.h"

namespace e4kv::serve {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
// The nesting the project's JSON readers accept (core/json.h): dump() recurses once per level,
// so a model writing 100,000 brackets must not reach it.
constexpr int kMaxJsonDepth = 256;

// One JSON value, or nullopt when `text` is not JSON or nests too deep. Never throws.
std::optional<Json> parse_bounded(std::string_view text) {
  bool too_deep = false;
  const Json::parser_callback_t check_depth = [&](int depth, Json::parse_event_t, Json&) {
    if (depth > kMaxJsonDepth) too_deep = true;
    return !too_deep;  // stop building what will be refused
  };
  try {
    Json value = Json::parse(text.data(), text.data() + text.size(), check_depth,
                             /*allow_exceptions=*/false);
    if (too_deep || value.is_discarded()) return std::nullopt;
    return value;
  } catch (const Json::exception&) {
    return std::nullopt;
  }
}

// The arguments of a call as compact JSON object text, or nullopt if they are not an object.
std::optional<std::string> arguments_text(const Json& call) {
  auto it = call.find("arguments");
  if (it == call.end()) it = call.find("parameters");
  if (it == call.end() || it->is_null()) return "{}";
  std::optional<Json> parsed_string;
  const Json* arguments = &*it;
  if (it->is_string()) {
    parsed_string = parse_bounded(it->get_ref<const std::string&>());
    if (!parsed_string) return std::nullopt;
    arguments = &*parsed_string;
  }
  if (!arguments->is_object()) return std::nullopt;
  return arguments->dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

// The tool call written in a block's text (between the tags), or nullopt if it is not one.
// The id is drawn only for a call, so that ids follow the calls in order.
std::optional<ToolCall> parse_block(std::string_view block, const ToolCallIdGenerator& make_id) {
  const std::optional<Json> call = parse_bounded(block);
  if (!call || !call->is_object()) return std::nullopt;
  const auto name = call->find("name");
  if (name == call->end() || !name->is_string() || name->get_ref<const std::string&>().empty()) {
    return std::nullopt;
  }
  std::optional<std::string> arguments = arguments_text(*call);
  if (!arguments) return std::nullopt;
  return ToolCall{.id = make_id ? make_id() : make_tool_call_id(),
                  .name = name->get<std::string>(),
                  .arguments = std::move(*arguments)};
}

size_t trailing_space(std::string_view text) {
  size_t n = 0;
  while (n < text.size() && is_tag_space(text[text.size() - 1 - n])) ++n;
  return n;
}

// Appends `text` to content, dropping its leading whitespace while `after_call` (the run after a
// tool call); a byte kept ends that run.
void append_text(std::string_view text, bool& after_call, std::string& content) {
  if (after_call) {
    size_t i = 0;
    while (i < text.size() && is_tag_space(text[i])) ++i;
    text.remove_prefix(i);
    if (!text.empty()) after_call = false;
  }
  content.append(text);
}

}  // namespace

std::string make_tool_call_id() {
  static constexpr std::string_view kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::uniform_int_distribution<size_t> pick(0, kAlphabet.size() - 1);
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlphabet[pick(rng)];
  return id;
}

ToolCallParse parse_tool_calls(std::string_view output, const ToolCallIdGenerator& make_id) {
  ToolCallParse result;
  bool after_call = false;
  size_t pos = 0;
  for (;;) {
    const size_t open = output.find(kCallOpen, pos);
    const size_t body = open == std::string_view::npos ? open : open + kCallOpen.size();
    const size_t close = body == std::string_view::npos ? body : output.find(kCallClose, body);
    if (close == std::string_view::npos) {  // no block, or one never closed: text to the end
      append_text(output.substr(pos), after_call, result.content);
      return result;
    }
    const size_t end = close + kCallClose.size();
    std::optional<ToolCall> call = parse_block(output.substr(body, close - body), make_id);
    if (!call) {
      append_text(output.substr(pos, end - pos), after_call, result.content);
    } else {
      append_text(output.substr(pos, open - pos), after_call, result.content);
      // The content so far ends at this block or at a '>' or a kept byte: its trailing whitespace
      // is the run right before the call.
      result.content.resize(result.content.size() - trailing_space(result.content));
      result.calls.push_back(std::move(*call));
      after_call = true;
    }
    pos = end;
  }
}

Json tool_call_json(const ToolCall& call) {
  return Json{{"id", call.id},
              {"type", "function"},
              {"function", Json{{"name", call.name}, {"arguments", call.arguments}}}};
}

Json tool_call_delta_json(const ToolCallDelta& delta) {
  if (!delta.first) {
    return Json{{"index", delta.index}, {"function", Json{{"arguments", delta.arguments}}}};
  }
  return Json{{"index", delta.index},
              {"id", delta.id},
              {"type", "function"},
              {"function", Json{{"name", delta.name}, {"arguments", delta.arguments}}}};
}

ToolCallParser::ToolCallParser(ToolCallIdGenerator make_id) : make_id_(std::move(make_id)) {}

void ToolCallParser::emit_text(std::string_view text, ToolCallStreamDelta& out) {
  append_text(text, after_call_, out.content);
}

ToolCallStreamDelta ToolCallParser::feed(std::string_view delta) {
  ToolCallStreamDelta out;
  (in_block_ ? block_ : pending_).append(delta);
  for (;;) {
    if (in_block_) {
      const size_t close = block_.find(kCallClose, block_scanned_);
      if (close == std::string::npos) {
        block_scanned_ = block_.size() - partial_tag_suffix(block_, kCallClose);
        return out;
      }
      std::optional<ToolCall> call =
          parse_block(std::string_view(block_).substr(0, close), make_id_);
      if (!call) {
        emit_text(space_before_, out);
        emit_text(kCallOpen, out);
        emit_text(std::string_view(block_).substr(0, close + kCallClose.size()), out);
      } else {
        const int index = n_calls_++;
        out.tool_calls.push_back(
            {.index = index, .first = true, .id = call->id, .name = call->name, .arguments = {}});
        out.tool_calls.push_back({.index = index, .arguments = std::move(call->arguments)});
        after_call_ = true;
      }
      pending_.assign(block_, close + kCallClose.size());
      block_.clear();
      space_before_.clear();
      block_scanned_ = 0;
      in_block_ = false;
      continue;
    }
    const size_t open = pending_.find(kCallOpen);
    if (open != std::string::npos) {
      const std::string_view before = std::string_view(pending_).substr(0, open);
      const size_t space = trailing_space(before);
      const std::string_view text = before.substr(0, before.size() - space);
      // With no text since the last call, the whitespace is that call's run: already dropped.
      const bool space_is_after_call = after_call_ && text.empty();
      emit_text(text, out);
      space_before_ = space_is_after_call ? std::string() : std::string(before.substr(text.size()));
      after_call_ = false;
      block_.assign(pending_, open + kCallOpen.size());
      pending_.clear();
      in_block_ = true;
      continue;
    }
    // Hold a possible "<tool_call" at the end and the whitespace before it.
    const size_t tag = partial_tag_suffix(pending_, kCallOpen);
    const std::string_view rest = std::string_view(pending_).substr(0, pending_.size() - tag);
    const size_t ready = rest.size() - trailing_space(rest);
    emit_text(std::string_view(pending_).substr(0, ready), out);
    pending_.erase(0, ready);
    return out;
  }
}

ToolCallStreamDelta ToolCallParser::finish() {
  ToolCallStreamDelta out;
  if (in_block_) {  // never closed: text
    emit_text(space_before_, out);
    emit_text(kCallOpen, out);
    emit_text(block_, out);
  } else {
    emit_text(pending_, out);
  }
  pending_.clear();
  block_.clear();
  space_before_.clear();
  in_block_ = false;
  return out;
}

}  // namespace e4kv::serve
