// Tool calls in the "hermes" form the Qwen2.5 and Qwen3 chat templates ask for. Their system
// prompt says: "For each function call, return a json object with function name and arguments
// within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments":
// <args-json-object>}\n</tool_call>"; several calls follow one another, after optional text.
//
// Rules (the streaming parser and parse_tool_calls() agree on every input, however it is cut):
//   - A block runs from "<tool_call>" to the first "</tool_call>" after it. A "</tool_call>"
//     written inside a JSON string therefore ends the block early; the JSON is then cut short,
//     does not parse, and the block stays text (below). Nested braces need no care: the JSON
//     parser sees the whole block.
//   - A block is a tool call when its text is one JSON object with a string "name" and arguments
//     under "arguments" (or "parameters"): an object, a string holding a JSON object, or
//     absent/null (= {}). Arguments become compact JSON text, keys in the model's order, UTF-8 as
//     is. JSON nested deeper than 256 levels is refused.
//   - Anything else stays in content byte for byte: a block that is not a tool call (its tags
//     included), a "<tool_call>" never closed, any "<" that is not a tag. Nothing is lost, and
//     nothing throws.
//   - The whitespace runs right before and right after each tool call (the "\n" the templates put
//     between text and calls) are dropped from content; other text is kept as is.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace e4kv::serve {

struct ToolCall {
  std::string id;         // "call_" + 24 alphanumerics
  std::string name;       // function.name
  std::string arguments;  // function.arguments: compact JSON object text
};

// Makes the id of each tool call in turn; tests inject a deterministic one.
using ToolCallIdGenerator = std::function<std::string()>;
// "call_" + 24 random alphanumerics.
std::string make_tool_call_id();

struct ToolCallParse {
  std::string content;          // the text outside tool calls
  std::vector<ToolCall> calls;  // non-empty -> finish_reason "tool_calls"
};

// The whole output at once. `make_id` defaults to make_tool_call_id.
ToolCallParse parse_tool_calls(std::string_view output, const ToolCallIdGenerator& make_id = {});

// One piece of OpenAI's streamed choices[].delta.tool_calls[]. The first delta of call `index`
// carries id, type "function", the name and empty arguments; the later ones carry only index
// and a piece of the arguments. Pieces of one call concatenate to its ToolCall::arguments.
struct ToolCallDelta {
  int index = 0;
  bool first = false;  // carries id, type and name
  std::string id;
  std::string name;
  std::string arguments;
};

struct ToolCallStreamDelta {
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
};

// {"id", "type": "function", "function": {"name", "arguments"}}: choices[].message.tool_calls[].
nlohmann::ordered_json tool_call_json(const ToolCall& call);
// {"index", "id", "type", "function": {"name", "arguments"}} for a first delta,
// {"index", "function": {"arguments"}} for a later one.
nlohmann::ordered_json tool_call_delta_json(const ToolCallDelta& delta);

// The same parse over a stream of text deltas. feed() returns content as soon as it cannot be part
// of a tool call: held back are a tag prefix at the end ("<tool_"), the whitespace run before it
// (dropped if a tool call follows) and an open block until its "</tool_call>" arrives; a complete
// call is returned as two deltas (header, then all its arguments). finish() returns the rest,
// an unterminated block as content. Call finish() once, after the last feed().
class ToolCallParser {
 public:
  explicit ToolCallParser(ToolCallIdGenerator make_id = {});

  ToolCallStreamDelta feed(std::string_view delta);
  ToolCallStreamDelta finish();

  // Whether any tool call was returned so far (the server then sets finish_reason "tool_calls").
  bool produced_tool_calls() const { return n_calls_ > 0; }

 private:
  void emit_text(std::string_view text, ToolCallStreamDelta& out);

  ToolCallIdGenerator make_id_;
  bool in_block_ = false;     // between "<tool_call>" and its "</tool_call>"
  bool after_call_ = false;   // dropping the whitespace after a tool call
  std::string pending_;       // outside a block: bytes not yet returned
  std::string space_before_;  // in a block: the whitespace run before its "<tool_call>"
  std::string block_;         // in a block: the bytes after "<tool_call>"
  size_t block_scanned_ = 0;  // in a block: bytes of block_ known not to start "</tool_call>"
  int n_calls_ = 0;
};

}  // namespace e4kv::serve
