// Splits a Qwen3-family chat output into reasoning and answer, as vLLM's `qwen3` reasoning parser
// does: the text inside <think>...</think> becomes `reasoning_content`, the rest `content`.
//
// Rules (the streaming parser and split_reasoning() agree on every input, however it is cut):
//   - A "<think>" at the very start of the output opens the reasoning and is dropped. A "<think>"
//     anywhere else is ordinary text.
//   - The output is also in reasoning from its first byte when the prompt already opened the block
//     (`starts_in_reasoning`; templates such as Qwen3.8's end the generation prompt with
//     "<think>\n" when thinking is on; see prompt_opens_reasoning()).
//   - In reasoning, the first "</think>" closes it; the tag and the whitespace right after it
//     (the template's "\n\n") are dropped, the rest is content.
//   - Reasoning that never closes is all reasoning. An output that never was in reasoning is all
//     content, a "</think>" in it included.
// Bytes are passed through untouched (reasoning keeps its own leading/trailing newlines, as vLLM's
// does); only the tags and the whitespace after "</think>" are removed.
#pragma once

#include <string>
#include <string_view>

namespace e4kv::serve {

struct ReasoningText {
  std::string reasoning;  // -> reasoning_content
  std::string content;    // -> content
};

// The whole output at once.
ReasoningText split_reasoning(std::string_view output, bool starts_in_reasoning);

// True when the rendered prompt ends inside an open think block: its last "<think>" is followed
// by nothing but whitespace (so it is the generation prompt's, not text of an earlier turn).
bool prompt_opens_reasoning(std::string_view prompt);

// The same split over a stream of text deltas. feed() returns what can be told apart so far,
// holding back only bytes that may still become a tag ("</thi" at the end of a delta) or the
// whitespace after "</think>" (dropped anyway); finish() returns the rest. Call finish() once,
// after the last feed().
class ReasoningParser {
 public:
  explicit ReasoningParser(bool starts_in_reasoning);

  ReasoningText feed(std::string_view delta);
  ReasoningText finish();

 private:
  enum class State {
    kOutputStart,     // the bytes so far may still be the opening "<think>"
    kReasoning,       // inside the think block
    kAfterReasoning,  // dropping the whitespace after "</think>"
    kContent,         // everything else is content
  };
  bool starts_in_reasoning_;
  State state_ = State::kOutputStart;
  std::string held_;  // bytes not yet returned
};

}  // namespace e4kv::serve
