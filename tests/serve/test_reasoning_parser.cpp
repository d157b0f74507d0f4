// The reasoning parser: outputs in the form the Qwen3 templates give them (checked against the
// templates themselves, rendered by the project's chat template engine), and the streaming parser
// against split_reasoning() for every way of cutting each output.
#include <algorithm>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "serve/reasoning_parser.h"
#include "testing/files.h"

namespace e4kv::serve {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;
using testing_support::read_text;

const fs::path kTemplateDir = fs::path(E4KV_SOURCE_DIR) / "tests" / "data" / "chat_templates";

ChatTemplate load_template(const std::string& name) {
  Result<ChatTemplate> chat =
      ChatTemplate::from_source(read_text(kTemplateDir / name / "template.jinja"));
  EXPECT_TRUE(chat.ok()) << chat.message();
  return std::move(chat).value();
}

// The parser fed `output` cut at `cuts` (increasing byte offsets), deltas concatenated.
ReasoningText stream(std::string_view output, const std::vector<size_t>& cuts,
                     bool starts_in_reasoning) {
  ReasoningParser parser(starts_in_reasoning);
  ReasoningText total;
  size_t from = 0;
  auto add = [&](const ReasoningText& delta) {
    total.reasoning += delta.reasoning;
    total.content += delta.content;
  };
  for (size_t cut : cuts) {
    add(parser.feed(output.substr(from, cut - from)));
    from = cut;
  }
  add(parser.feed(output.substr(from)));
  add(parser.finish());
  return total;
}

// Outputs that exercise every state and tag boundary.
const std::vector<std::string>& corpus() {
  static const std::vector<std::string> outputs = {
      "",
      "<",
      "<thi",
      "<think>",
      "<think></think>",
      "</think>",
      "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is 4.",
      "The user asks for 2+2.\n</think>\n\nThe answer is 4.",
      "<think>\nStill thinking when the tokens ran out",
      "Plain answer with no think block.",
      "Plain answer that mentions </think> and <think> as text.",
      " <think>not at the start</think> text",
      "<think>a < b and c </thinking> d </think",
      "<think>x</think> \t\r\n  y \n",
      "<think>x</think>\n\n",
      "<think>一つ目の考え。</think>\n\n答えは「四」です。😀",
      "<think><think>nested open</think></think>after",
      "<<think>>",
  };
  return outputs;
}

void expect_same(const ReasoningText& got, const ReasoningText& want, const std::string& label) {
  EXPECT_EQ(got.reasoning, want.reasoning) << label;
  EXPECT_EQ(got.content, want.content) << label;
}

TEST(ReasoningParser, Qwen3ThinkingOutput) {
  // The Qwen3 template (tests/data/chat_templates/qwen3) renders a thinking turn as
  // '<think>\n' + reasoning + '\n</think>\n\n' + content; the model writes the same.
  const ReasoningText split = split_reasoning(
      "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is 4.", false);
  EXPECT_EQ(split.reasoning, "\nThe user asks for 2+2. That is 4.\n");
  EXPECT_EQ(split.content, "The answer is 4.");
}

TEST(ReasoningParser, PromptOpenedTheBlock) {
  // Qwen3.8's generation prompt ends with "<think>\n": the output starts inside the block.
  const std::string output = "\nThe user asks for 2+2.\n</think>\n\nThe answer is 4.";
  const ReasoningText split = split_reasoning(output, true);
  EXPECT_EQ(split.reasoning, "\nThe user asks for 2+2.\n");
  EXPECT_EQ(split.content, "The answer is 4.");
  // The same output without that option is plain content, the tag included.
  EXPECT_EQ(split_reasoning(output, false).content, output);
  EXPECT_EQ(split_reasoning(output, false).reasoning, "");
  // A model that writes "<think>" again anyway: the tag is still dropped.
  EXPECT_EQ(split_reasoning("<think>r</think>c", true).reasoning, "r");
}

TEST(ReasoningParser, UnclosedAndPlainOutputs) {
  expect_same(split_reasoning("<think>\nran out of tokens", false),
              {.reasoning = "\nran out of tokens", .content = ""}, "opened, never closed");
  expect_same(split_reasoning("ran out of tokens", true),
              {.reasoning = "ran out of tokens", .content = ""}, "prompt-opened, never closed");
  expect_same(split_reasoning("Just an answer.", false),
              {.reasoning = "", .content = "Just an answer."}, "plain");
  expect_same(split_reasoning("Hi <think>x</think> there", false),
              {.reasoning = "", .content = "Hi <think>x</think> there"}, "tag not at the start");
  expect_same(split_reasoning("<thi", false), {.reasoning = "", .content = "<thi"}, "tag prefix");
  expect_same(split_reasoning("<thi", true), {.reasoning = "<thi", .content = ""},
              "tag prefix in reasoning");
  expect_same(split_reasoning("", false), {}, "empty");
  // "</thinking>" is not "</think>"; only whitespace after the tag is dropped.
  expect_same(split_reasoning("<think>a < b </thinking> c</think> \n\t next \n", false),
              {.reasoning = "a < b </thinking> c", .content = "next \n"}, "near-tags");
}

TEST(ReasoningParser, AgreesWithTheQwen3TemplateRendering) {
  // The template renders reasoning_content and content of the last assistant turn; splitting that
  // turn back must give them again (the template strips the reasoning's outer newlines and
  // writes one each side).
  const ChatTemplate chat = load_template("qwen3");
  const std::string reasoning = "The user wants 17*3. 17*3 = 51.";
  const std::string content = "17 × 3 = **51**.";
  const ordered_json messages = ordered_json::array(
      {{{"role", "user"}, {"content", "What is 17*3?"}},
       {{"role", "assistant"}, {"reasoning_content", reasoning}, {"content", content}}});
  ChatRenderOptions options;
  options.add_generation_prompt = false;
  const Result<std::string> rendered = chat.render(messages, options);
  ASSERT_TRUE(rendered.ok()) << rendered.message();
  const std::string header = "<|im_start|>assistant\n";
  const size_t start = rendered->rfind(header);
  const size_t end = rendered->rfind("<|im_end|>");
  ASSERT_NE(start, std::string::npos);
  ASSERT_NE(end, std::string::npos);
  const std::string output = rendered->substr(start + header.size(), end - start - header.size());
  const ReasoningText split = split_reasoning(output, false);
  EXPECT_EQ(split.reasoning, "\n" + reasoning + "\n") << output;
  EXPECT_EQ(split.content, content) << output;
  EXPECT_EQ(stream(output, {}, false).content, content);
}

TEST(ReasoningParser, PromptOpensReasoningFollowsTheTemplates) {
  const ordered_json messages =
      ordered_json::array({{{"role", "user"}, {"content", "Hi"}},
                           {{"role", "assistant"}, {"content", "<think>\nold\n</think>\n\nHello"}},
                           {{"role", "user"}, {"content", "Say <think> please"}}});
  struct Case {
    std::string template_name;
    bool enable_thinking;
    bool opens;
  };
  // Qwen3.8 opens the block in the prompt when thinking is on; Qwen3 lets the model write
  // "<think>" itself, and both close an empty block in the prompt when thinking is off.
  for (const Case& c : {Case{"qwen3_8", true, true}, Case{"qwen3_8", false, false},
                        Case{"qwen3", true, false}, Case{"qwen3", false, false}}) {
    const ChatTemplate chat = load_template(c.template_name);
    ChatRenderOptions options;
    options.extra = {{"enable_thinking", c.enable_thinking}};
    const Result<std::string> prompt = chat.render(messages, options);
    ASSERT_TRUE(prompt.ok()) << prompt.message();
    EXPECT_EQ(prompt_opens_reasoning(*prompt), c.opens)
        << c.template_name << " enable_thinking=" << c.enable_thinking << "\n"
        << *prompt;
  }
  EXPECT_FALSE(prompt_opens_reasoning("user wrote <think> x"));
  EXPECT_TRUE(prompt_opens_reasoning("assistant\n<think>\n"));
}

TEST(ReasoningParser, StreamingHoldsBackOnlyATagPrefix) {
  ReasoningParser parser(false);
  ReasoningText delta = parser.feed("<thi");
  EXPECT_EQ(delta.reasoning + delta.content, "");  // may still be "<think>"
  delta = parser.feed("nk>\nStep one. </th");
  EXPECT_EQ(delta.reasoning, "\nStep one. ");  // "</th" held
  delta = parser.feed("ink>\n");
  EXPECT_EQ(delta.reasoning + delta.content, "");  // the tag and the whitespace after it
  delta = parser.feed("\nAnswer <b>");
  EXPECT_EQ(delta.content, "Answer <b>");  // content is never held
  delta = parser.feed(" </think>");
  EXPECT_EQ(delta.content, " </think>");
  delta = parser.finish();
  EXPECT_EQ(delta.reasoning + delta.content, "");

  ReasoningParser in_reasoning(true);
  delta = in_reasoning.feed("x <");
  EXPECT_EQ(delta.reasoning, "x ");
  delta = in_reasoning.feed("y");
  EXPECT_EQ(delta.reasoning, "<y");

  ReasoningParser plain(false);
  EXPECT_EQ(plain.feed("Hello").content, "Hello");  // "H" already rules out "<think>"
}

TEST(ReasoningParser, StreamingEqualsWholeAtEverySplitPoint) {
  for (bool starts_in_reasoning : {false, true}) {
    for (const std::string& output : corpus()) {
      const ReasoningText whole = split_reasoning(output, starts_in_reasoning);
      const std::string label =
          "starts_in_reasoning=" + std::to_string(starts_in_reasoning) + " output=" + output;
      expect_same(stream(output, {}, starts_in_reasoning), whole, label);
      for (size_t cut = 0; cut <= output.size(); ++cut) {
        expect_same(stream(output, {cut}, starts_in_reasoning), whole,
                    label + " cut=" + std::to_string(cut));
      }
      for (size_t a = 0; a <= output.size() && output.size() <= 40; ++a) {
        for (size_t b = a; b <= output.size(); ++b) {
          expect_same(stream(output, {a, b}, starts_in_reasoning), whole,
                      label + " cuts=" + std::to_string(a) + "," + std::to_string(b));
        }
      }
      std::vector<size_t> every_byte;
      for (size_t i = 1; i < output.size(); ++i) every_byte.push_back(i);
      expect_same(stream(output, every_byte, starts_in_reasoning), whole, label + " bytewise");
    }
  }
}

TEST(ReasoningParser, StreamingEqualsWholeForRandomSplits) {
  std::mt19937 rng(20261206);
  for (bool starts_in_reasoning : {false, true}) {
    for (const std::string& output : corpus()) {
      const ReasoningText whole = split_reasoning(output, starts_in_reasoning);
      for (int trial = 0; trial < 200; ++trial) {
        std::vector<size_t> cuts;
        std::uniform_int_distribution<size_t> offset(0, output.size());
        const int n_cuts = std::uniform_int_distribution<int>(1, 8)(rng);
        for (int i = 0; i < n_cuts; ++i) cuts.push_back(offset(rng));
        std::sort(cuts.begin(), cuts.end());
        std::string label = "output=" + output + " cuts=";
        for (size_t cut : cuts) label += std::to_string(cut) + ",";
        expect_same(stream(output, cuts, starts_in_reasoning), whole, label);
      }
    }
  }
}

}  // namespace
}  // namespace e4kv::serve
