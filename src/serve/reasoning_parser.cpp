#include "serve/reasoning_parser.h"

#include "serve/tag_scan.h"

namespace e4kv::serve {
namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";

std::string_view drop_leading_space(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && is_tag_space(text[i])) ++i;
  return text.substr(i);
}

}  // namespace

ReasoningText split_reasoning(std::string_view output, bool starts_in_reasoning) {
  bool in_reasoning = starts_in_reasoning;
  if (output.starts_with(kThinkOpen)) {
    output.remove_prefix(kThinkOpen.size());
    in_reasoning = true;
  }
  if (!in_reasoning) return {.reasoning = {}, .content = std::string(output)};
  const size_t close = output.find(kThinkClose);
  if (close == std::string_view::npos) return {.reasoning = std::string(output), .content = {}};
  return {.reasoning = std::string(output.substr(0, close)),
          .content = std::string(drop_leading_space(output.substr(close + kThinkClose.size())))};
}

bool prompt_opens_reasoning(std::string_view prompt) {
  const size_t open = prompt.rfind(kThinkOpen);
  if (open == std::string_view::npos) return false;
  return drop_leading_space(prompt.substr(open + kThinkOpen.size())).empty();
}

ReasoningParser::ReasoningParser(bool starts_in_reasoning)
    : starts_in_reasoning_(starts_in_reasoning) {}

ReasoningText ReasoningParser::feed(std::string_view delta) {
  held_.append(delta);
  ReasoningText out;
  for (;;) {
    switch (state_) {
      case State::kOutputStart:
        if (held_.starts_with(kThinkOpen)) {
          held_.erase(0, kThinkOpen.size());
          state_ = State::kReasoning;
          break;
        }
        if (kThinkOpen.starts_with(held_)) return out;  // may still become "<think>"
        state_ = starts_in_reasoning_ ? State::kReasoning : State::kContent;
        break;
      case State::kReasoning: {
        const size_t close = held_.find(kThinkClose);
        if (close != std::string::npos) {
          out.reasoning.append(held_, 0, close);
          held_.erase(0, close + kThinkClose.size());
          state_ = State::kAfterReasoning;
          break;
        }
        const size_t ready = held_.size() - partial_tag_suffix(held_, kThinkClose);
        out.reasoning.append(held_, 0, ready);
        held_.erase(0, ready);
        return out;
      }
      case State::kAfterReasoning: {
        const std::string_view rest = drop_leading_space(held_);
        if (rest.empty()) {
          held_.clear();
          return out;
        }
        held_.erase(0, held_.size() - rest.size());
        state_ = State::kContent;
        break;
      }
      case State::kContent:
        out.content.append(held_);
        held_.clear();
        return out;
    }
  }
}

ReasoningText ReasoningParser::finish() {
  ReasoningText out;
  switch (state_) {
    case State::kOutputStart:  // a prefix of "<think>" and no more: it was text
      (starts_in_reasoning_ ? out.reasoning : out.content).append(held_);
      break;
    case State::kReasoning:
      out.reasoning.append(held_);
      break;
    case State::kAfterReasoning:  // only whitespace held; dropped
    case State::kContent:
      break;
  }
  held_.clear();
  return out;
}

}  // namespace e4kv::serve
