// The hermes tool-call parser: outputs in the form the Qwen2.5 and Qwen3 templates ask for (and
// render, through the project's chat template engine), text that is not a tool call kept byte for
// byte, and the streaming parser against parse_tool_calls() for every way of cutting each output.
#include <algorithm>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "serve/reasoning_parser.h"
#include "serve/tool_call_parser.h"
#include "testing/files.h"

namespace e4kv::serve {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;
using testing_support::read_text;

const fs::path kTemplateDir = fs::path(E4KV_SOURCE_DIR) / "tests" / "data" / "chat_templates";

// Ids "call_0", "call_1", ... so that two runs can be compared.
ToolCallIdGenerator counting_ids() {
  return [n = 0]() mutable { return "call_" + std::to_string(n++); };
}

const std::string kWeatherParis =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": "
    "\"celsius\"}}\n</tool_call>";
const std::string kWeatherTokyo =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\", \"unit\": "
    "\"celsius\"}}\n</tool_call>";

struct Streamed {
  std::string content;
  std::vector<ToolCall> calls;  // rebuilt from the deltas
  bool produced = false;
};

// The parser fed `output` cut at `cuts` (increasing byte offsets); checks each delta's shape.
Streamed stream(std::string_view output, const std::vector<size_t>& cuts) {
  ToolCallParser parser(counting_ids());
  Streamed total;
  auto add = [&](const ToolCallStreamDelta& delta) {
    total.content += delta.content;
    for (const ToolCallDelta& call : delta.tool_calls) {
      if (call.first) {
        EXPECT_EQ(call.index, static_cast<int>(total.calls.size()));
        EXPECT_EQ(call.arguments, "");
        total.calls.push_back({.id = call.id, .name = call.name, .arguments = {}});
      } else {
        EXPECT_EQ(call.index + 1, static_cast<int>(total.calls.size()));
        EXPECT_TRUE(call.id.empty() && call.name.empty());
        total.calls.back().arguments += call.arguments;
      }
    }
  };
  size_t from = 0;
  for (size_t cut : cuts) {
    add(parser.feed(output.substr(from, cut - from)));
    from = cut;
  }
  add(parser.feed(output.substr(from)));
  add(parser.finish());
  total.produced = parser.produced_tool_calls();
  return total;
}

void expect_same(const Streamed& got, const ToolCallParse& want, const std::string& label) {
  EXPECT_EQ(got.content, want.content) << label;
  EXPECT_EQ(got.produced, !want.calls.empty()) << label;
  ASSERT_EQ(got.calls.size(), want.calls.size()) << label;
  for (size_t i = 0; i < want.calls.size(); ++i) {
    EXPECT_EQ(got.calls[i].id, want.calls[i].id) << label;
    EXPECT_EQ(got.calls[i].name, want.calls[i].name) << label;
    EXPECT_EQ(got.calls[i].arguments, want.calls[i].arguments) << label;
  }
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> outputs = {
      "",
      "<",
      "<tool_",
      "<tool_call>",
      "</tool_call>",
      "Plain answer, no tools.",
      kWeatherParis,
      "Let me check both cities.\n" + kWeatherParis + "\n" + kWeatherTokyo,
      kWeatherParis + "\n\nBoth are sunny.\n",
      "a < b, x<tool>y</tool>, <tool_cal <tool_call",
      "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}",  // never closed
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>\n" + kWeatherParis,
      kWeatherParis + "\n<tool_call>not json</tool_call> \n" + kWeatherTokyo + " \n",
      "<tool_call>{\"name\": \"echo\", \"arguments\": {\"text\": \"a </tool_call> "
      "b\"}}</tool_call>",
      "<tool_call>{\"name\": \"f\", \"arguments\": {\"s\": \"}{\", \"n\": {\"m\": [1, {\"k\": "
      "\"]\"}]}}}</tool_call>",
      "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
      " \n" + kWeatherParis + kWeatherTokyo + "\n \nDone.",
      "Zürich — 東京 😀\n<tool_call>{\"name\": \"translate\", \"arguments\": {\"text\": "
      "\"Grüße, 世界 😀\"}}</tool_call>\nそれで",
      "<tool_call><tool_call>{\"name\": \"f\"}</tool_call></tool_call>",
  };
  return outputs;
}

TEST(ToolCallParser, TheTemplatesAskForThisForm) {
  // Both templates' system prompts give the form parsed here, verbatim.
  const std::string form =
      "For each function call, return a json object with function name and arguments within "
      "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
      "\\\"arguments\\\": <args-json-object>}\\n</tool_call>";
  for (const char* name : {"qwen3", "qwen2_5"}) {
    EXPECT_NE(read_text(kTemplateDir / name / "template.jinja").find(form), std::string::npos)
        << name;
  }
}

TEST(ToolCallParser, OneCall) {
  const ToolCallParse parse = parse_tool_calls(kWeatherParis, counting_ids());
  EXPECT_EQ(parse.content, "");
  ASSERT_EQ(parse.calls.size(), 1u);
  EXPECT_EQ(parse.calls[0].id, "call_0");
  EXPECT_EQ(parse.calls[0].name, "get_weather");
  EXPECT_EQ(parse.calls[0].arguments, R"({"city":"Paris","unit":"celsius"})");
}

TEST(ToolCallParser, TextThenSeveralCalls) {
  const ToolCallParse parse = parse_tool_calls(
      "Let me check both cities.\n" + kWeatherParis + "\n" + kWeatherTokyo, counting_ids());
  EXPECT_EQ(parse.content, "Let me check both cities.");
  ASSERT_EQ(parse.calls.size(), 2u);
  EXPECT_EQ(parse.calls[0].id, "call_0");
  EXPECT_EQ(parse.calls[1].id, "call_1");
  EXPECT_EQ(parse.calls[1].arguments, R"({"city":"Tokyo","unit":"celsius"})");
  // Text after the calls is kept, the whitespace touching them is not.
  EXPECT_EQ(parse_tool_calls(kWeatherParis + "\n\nBoth are sunny.\n").content, "Both are sunny.\n");
}

TEST(ToolCallParser, ArgumentForms) {
  auto arguments = [](const std::string& block) {
    const ToolCallParse parse = parse_tool_calls("<tool_call>" + block + "</tool_call>");
    EXPECT_EQ(parse.calls.size(), 1u) << block;
    return parse.calls.empty() ? std::string("(none)") : parse.calls[0].arguments;
  };
  // A string holding JSON (the Qwen3 template passes string arguments through as they are).
  EXPECT_EQ(arguments(R"({"name": "f", "arguments": "{\"a\": 1, \"b\": [1, 2]}"})"),
            R"({"a":1,"b":[1,2]})");
  EXPECT_EQ(arguments(R"({"name": "f", "parameters": {"a": true}})"), R"({"a":true})");
  EXPECT_EQ(arguments(R"({"name": "f"})"), "{}");
  EXPECT_EQ(arguments(R"({"name": "f", "arguments": null})"), "{}");
  // The model's key order, and UTF-8 as is (OpenAI clients json.loads the string).
  EXPECT_EQ(arguments(R"({"arguments": {"z": 1, "a": {"y": 2, "b": 3}}, "name": "f"})"),
            R"({"z":1,"a":{"y":2,"b":3}})");
  EXPECT_EQ(arguments(R"({"name": "f", "arguments": {"text": "Grüße 世界 😀"}})"),
            R"({"text":"Grüße 世界 😀"})");
  // Braces inside strings and nested objects.
  EXPECT_EQ(arguments(R"({"name": "f", "arguments": {"s": "}{", "n": {"m": [1, {"k": "]"}]}}})"),
            R"({"s":"}{","n":{"m":[1,{"k":"]"}]}})");
}

TEST(ToolCallParser, BlocksThatAreNotCallsStayText) {
  const std::vector<std::string> blocks = {
      "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",  // cut short
      "<tool_call>\n{\"arguments\": {\"a\": 1}}\n</tool_call>",                  // no name
      "<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>",
      "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>",
      "<tool_call>{\"name\": \"f\", \"arguments\": [1, 2]}</tool_call>",
      "<tool_call>{\"name\": \"f\", \"arguments\": \"not json\"}</tool_call>",
      "<tool_call>{\"name\": \"f\", \"arguments\": \"[1]\"}</tool_call>",
      "<tool_call>[\"f\"]</tool_call>",
      "<tool_call>{\"name\": \"f\"} trailing</tool_call>",
      "<tool_call></tool_call>",
  };
  for (const std::string& block : blocks) {
    const std::string output = "Before.\n" + block + "\nAfter.";
    const ToolCallParse parse = parse_tool_calls(output);
    EXPECT_TRUE(parse.calls.empty()) << block;
    EXPECT_EQ(parse.content, output) << block;
  }
  // Beside real calls: the whitespace touching a call goes, the bad block stays whole.
  const ToolCallParse mixed = parse_tool_calls(
      kWeatherParis + "\n<tool_call>not json</tool_call> \n" + kWeatherTokyo + " \n",
      counting_ids());
  EXPECT_EQ(mixed.content, "<tool_call>not json</tool_call>");
  ASSERT_EQ(mixed.calls.size(), 2u);
  EXPECT_EQ(mixed.calls[1].id, "call_1");  // ids count calls only
}

TEST(ToolCallParser, CloseTagInsideAJsonString) {
  // The first "</tool_call>" ends the block, cutting the JSON short: the whole output is text.
  const std::string output =
      "<tool_call>\n{\"name\": \"echo\", \"arguments\": {\"text\": \"a </tool_call> b\"}}\n"
      "</tool_call>";
  const ToolCallParse parse = parse_tool_calls(output);
  EXPECT_TRUE(parse.calls.empty());
  EXPECT_EQ(parse.content, output);
}

TEST(ToolCallParser, UnterminatedBlockIsText) {
  const std::string output = "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}";
  const ToolCallParse parse = parse_tool_calls(output);
  EXPECT_TRUE(parse.calls.empty());
  EXPECT_EQ(parse.content, output);

  ToolCallParser parser;
  const ToolCallStreamDelta first = parser.feed(output);
  EXPECT_EQ(first.content, "Sure.");  // the block and the "\n" before it wait for a close
  const ToolCallStreamDelta last = parser.finish();
  EXPECT_EQ(last.content, output.substr(5));
  EXPECT_FALSE(parser.produced_tool_calls());
}

TEST(ToolCallParser, AngleBracketsThatAreNotTags) {
  const std::string output = "if a < b and x<tool>y</tool>, then <tool_cal <tool_call";
  EXPECT_EQ(parse_tool_calls(output).content, output);
}

TEST(ToolCallParser, DeepNestingIsRefusedNotOverflowed) {
  const std::string deep = std::string(100'000, '[') + std::string(100'000, ']');
  for (const std::string& block : {"{\"name\": \"f\", \"arguments\": {\"x\": " + deep + "}}",
                                   "{\"name\": \"f\", \"arguments\": " +
                                       nlohmann::json("{\"x\": " + deep + "}").dump() + "}"}) {
    const std::string output = "<tool_call>" + block + "</tool_call>";
    const ToolCallParse parse = parse_tool_calls(output);
    EXPECT_TRUE(parse.calls.empty());
    EXPECT_EQ(parse.content, output);
  }
  // Moderate nesting is fine.
  const std::string nested = std::string(100, '[') + std::string(100, ']');
  EXPECT_EQ(parse_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": " + nested +
                             "}}</tool_call>")
                .calls.size(),
            1u);
}

TEST(ToolCallParser, RecoversWhatTheTemplatesRender) {
  // An assistant turn with content and tool calls, rendered by each template, parsed back.
  const ordered_json paris = {{"city", "Paris"}, {"unit", "celsius"}};
  const ordered_json search = {{"query", "e4m3 \"kv\" cache"}, {"filters", {{"year", 2026}}}};
  struct Case {
    std::string template_name;
    bool arguments_as_string;
  };
  for (const Case& c : {Case{"qwen2_5", false}, Case{"qwen3", false}, Case{"qwen3", true}}) {
    auto call = [&](const std::string& name, const ordered_json& arguments) {
      return ordered_json{
          {"type", "function"},
          {"function",
           {{"name", name},
            {"arguments", c.arguments_as_string ? ordered_json(arguments.dump()) : arguments}}}};
    };
    const ordered_json messages = ordered_json::array(
        {{{"role", "user"}, {"content", "Weather in Paris, and search the web."}},
         {{"role", "assistant"},
          {"content", "I'll look both up."},
          {"tool_calls", {call("get_weather", paris), call("web_search", search)}}}});
    const Result<ChatTemplate> chat =
        ChatTemplate::from_source(read_text(kTemplateDir / c.template_name / "template.jinja"));
    ASSERT_TRUE(chat.ok()) << chat.message();
    ChatRenderOptions options;
    options.add_generation_prompt = false;
    const Result<std::string> rendered = chat->render(messages, options);
    ASSERT_TRUE(rendered.ok()) << rendered.message();
    const std::string header = "<|im_start|>assistant\n";
    const size_t start = rendered->rfind(header);
    const size_t end = rendered->rfind("<|im_end|>");
    ASSERT_TRUE(start != std::string::npos && end != std::string::npos) << *rendered;
    std::string output = rendered->substr(start + header.size(), end - start - header.size());
    // Qwen3 writes the turn's (empty) think block first.
    const ReasoningText split = split_reasoning(output, false);
    const ToolCallParse parse = parse_tool_calls(split.content, counting_ids());
    const std::string label = c.template_name + "\n" + output;
    EXPECT_EQ(parse.content, "I'll look both up.") << label;
    ASSERT_EQ(parse.calls.size(), 2u) << label;
    EXPECT_EQ(parse.calls[0].name, "get_weather");
    EXPECT_EQ(parse.calls[0].arguments, paris.dump());
    EXPECT_EQ(parse.calls[1].name, "web_search");
    EXPECT_EQ(parse.calls[1].arguments, search.dump());
    expect_same(stream(split.content, {}), parse, label);
  }
}

// "call_" and 24 ASCII letters or digits (no <regex>: GCC 12 warns inside it under sanitizers).
bool is_call_id(const std::string& id) {
  if (id.size() != 29 || id.rfind("call_", 0) != 0) return false;
  return std::all_of(id.begin() + 5, id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
  });
}

TEST(ToolCallParser, IdsAreCallPlus24Alphanumerics) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = make_tool_call_id();
    EXPECT_TRUE(is_call_id(id)) << id;
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 1000u);
  const ToolCallParse parse = parse_tool_calls(kWeatherParis);  // the default generator
  ASSERT_EQ(parse.calls.size(), 1u);
  EXPECT_TRUE(is_call_id(parse.calls[0].id)) << parse.calls[0].id;
}

TEST(ToolCallParser, JsonShapes) {
  const ToolCall call{.id = "call_x", .name = "f", .arguments = R"({"a":1})"};
  EXPECT_EQ(tool_call_json(call).dump(),
            R"({"id":"call_x","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}})");
  EXPECT_EQ(
      tool_call_delta_json({.index = 2, .first = true, .id = "call_x", .name = "f"}).dump(),
      R"({"index":2,"id":"call_x","type":"function","function":{"name":"f","arguments":""}})");
  EXPECT_EQ(tool_call_delta_json({.index = 2, .arguments = R"({"a":1})"}).dump(),
            R"({"index":2,"function":{"arguments":"{\"a\":1}"}})");
}

TEST(ToolCallParser, StreamingHoldsBackOnlyWhatMayBeACall) {
  ToolCallParser parser(counting_ids());
  EXPECT_EQ(parser.feed("Let me").content, "Let me");
  EXPECT_EQ(parser.feed(" check <tool_").content, " check");  // " <tool_" may open a call
  EXPECT_EQ(parser.feed("x").content, " <tool_x");
  EXPECT_EQ(parser.feed(".\n<tool_call>\n{\"name\": \"get_weather\", ").content, ".");
  ToolCallStreamDelta delta = parser.feed("\"arguments\": {\"city\": \"Paris\"}}\n</tool_");
  EXPECT_TRUE(delta.content.empty() && delta.tool_calls.empty());
  EXPECT_FALSE(parser.produced_tool_calls());
  delta = parser.feed("call>\n");
  EXPECT_EQ(delta.content, "");
  ASSERT_EQ(delta.tool_calls.size(), 2u);
  EXPECT_EQ(
      tool_call_delta_json(delta.tool_calls[0]).dump(),
      R"({"index":0,"id":"call_0","type":"function","function":{"name":"get_weather","arguments":""}})");
  EXPECT_EQ(tool_call_delta_json(delta.tool_calls[1]).dump(),
            R"({"index":0,"function":{"arguments":"{\"city\":\"Paris\"}"}})");
  EXPECT_TRUE(parser.produced_tool_calls());
  EXPECT_EQ(parser.feed("Done").content, "Done");
  EXPECT_EQ(parser.finish().content, "");
}

TEST(ToolCallParser, StreamingEqualsWholeAtEverySplitPoint) {
  for (const std::string& output : corpus()) {
    const ToolCallParse whole = parse_tool_calls(output, counting_ids());
    expect_same(stream(output, {}), whole, output);
    for (size_t cut = 0; cut <= output.size(); ++cut) {
      expect_same(stream(output, {cut}), whole, output + " cut=" + std::to_string(cut));
    }
    std::vector<size_t> every_byte;
    for (size_t i = 1; i < output.size(); ++i) every_byte.push_back(i);
    expect_same(stream(output, every_byte), whole, output + " bytewise");
  }
}

TEST(ToolCallParser, StreamingEqualsWholeForRandomSplits) {
  std::mt19937 rng(20261206);
  for (const std::string& output : corpus()) {
    const ToolCallParse whole = parse_tool_calls(output, counting_ids());
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<size_t> cuts;
      std::uniform_int_distribution<size_t> offset(0, output.size());
      const int n_cuts = std::uniform_int_distribution<int>(1, 10)(rng);
      for (int i = 0; i < n_cuts; ++i) cuts.push_back(offset(rng));
      std::sort(cuts.begin(), cuts.end());
      std::string label = output + " cuts=";
      for (size_t cut : cuts) label += std::to_string(cut) + ",";
      expect_same(stream(output, cuts), whole, label);
    }
  }
}

TEST(ToolCallParser, AfterTheReasoningParser) {
  // The server runs the reasoning parser first and the tool-call parser over its content.
  const std::string output =
      "<think>\nThe user wants the weather; call the tool.\n</think>\n\n" + kWeatherParis;
  const ReasoningText split = split_reasoning(output, false);
  EXPECT_EQ(split.reasoning, "\nThe user wants the weather; call the tool.\n");
  const ToolCallParse whole = parse_tool_calls(split.content, counting_ids());
  EXPECT_EQ(whole.content, "");
  ASSERT_EQ(whole.calls.size(), 1u);
  for (size_t cut = 0; cut <= output.size(); ++cut) {
    ReasoningParser reasoning(false);
    ToolCallParser tools(counting_ids());
    std::string reasoning_text;
    Streamed total;
    auto through = [&](const ReasoningText& r) {
      reasoning_text += r.reasoning;
      const ToolCallStreamDelta d = tools.feed(r.content);
      total.content += d.content;
      for (const ToolCallDelta& call : d.tool_calls) {
        if (call.first)
          total.calls.push_back({.id = call.id, .name = call.name, .arguments = {}});
        else
          total.calls.back().arguments += call.arguments;
      }
    };
    through(reasoning.feed(output.substr(0, cut)));
    through(reasoning.feed(output.substr(cut)));
    through(reasoning.finish());
    const ToolCallStreamDelta last = tools.finish();
    total.content += last.content;
    total.produced = tools.produced_tool_calls();
    EXPECT_EQ(reasoning_text, split.reasoning) << cut;
    expect_same(total, whole, "cut=" + std::to_string(cut));
  }
}

}  // namespace
}  // namespace e4kv::serve
