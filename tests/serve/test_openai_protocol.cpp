// The protocol of e4kv serve without HTTP: request checking (every refusal names its field) and
// the response shapes built from the engine's outputs, against OpenAI's documented shapes.
#include "serve/openai_protocol.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace e4kv::serve {
namespace {

ProtocolLimits limits() {
  ProtocolLimits l;
  l.max_model_len = 4096;
  return l;
}

std::optional<ApiError> parse(Endpoint endpoint, const std::string& body, ParsedRequest* out) {
  return parse_request(endpoint, json::parse(body), limits(), out);
}

// The field a refusal names, or "" when the body was accepted.
std::string refused_field(Endpoint endpoint, const std::string& body) {
  ParsedRequest out;
  std::optional<ApiError> err = parse(endpoint, body, &out);
  if (!err) return "";
  EXPECT_EQ(err->status, 400) << body;
  EXPECT_NE(err->message.find(err->param), std::string::npos) << err->message;
  return err->param.empty() ? "<none>" : err->param;
}

TEST(OpenAiProtocol, CompletionFieldsBecomeSamplingParams) {
  ParsedRequest r;
  ASSERT_FALSE(parse(Endpoint::kCompletions,
                     R"({"model": "m", "prompt": "hello", "max_tokens": 7, "temperature": 0.5,
                         "top_p": 0.9, "top_k": 40, "min_p": 0.05, "n": 3, "seed": 11,
                         "stop": ["a", "bc"], "presence_penalty": 0.5, "frequency_penalty": -0.5,
                         "repetition_penalty": 1.1, "logit_bias": {"5": -100, "17": 2.5},
                         "logprobs": 4, "ignore_eos": true, "min_tokens": 2,
                         "stop_token_ids": [3, 4], "user": "ignored"})",
                     &r));
  EXPECT_EQ(r.model, "m");
  ASSERT_TRUE(r.prompt.text.has_value());
  EXPECT_EQ(*r.prompt.text, "hello");
  EXPECT_EQ(r.params.max_tokens, 7);
  EXPECT_TRUE(r.max_tokens_given);
  EXPECT_DOUBLE_EQ(r.params.temperature, 0.5);
  EXPECT_DOUBLE_EQ(r.params.top_p, 0.9);
  EXPECT_EQ(r.params.top_k, 40);
  EXPECT_DOUBLE_EQ(r.params.min_p, 0.05);
  EXPECT_EQ(r.params.n, 3);
  EXPECT_EQ(r.params.seed, 11u);
  EXPECT_TRUE(r.seed_given);
  EXPECT_EQ(r.params.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_DOUBLE_EQ(r.params.presence_penalty, 0.5);
  EXPECT_DOUBLE_EQ(r.params.frequency_penalty, -0.5);
  EXPECT_DOUBLE_EQ(r.params.repetition_penalty, 1.1);
  EXPECT_EQ(r.params.logit_bias.size(), 2u);
  EXPECT_DOUBLE_EQ(r.params.logit_bias.at(5), -100.0);
  EXPECT_DOUBLE_EQ(r.params.logit_bias.at(17), 2.5);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.params.logprobs, 4);
  EXPECT_TRUE(r.params.ignore_eos);
  EXPECT_EQ(r.params.min_tokens, 2);
  EXPECT_EQ(r.params.stop_token_ids, (std::vector<int32_t>{3, 4}));
  EXPECT_FALSE(r.stream);
}

TEST(OpenAiProtocol, DefaultsAreOpenAis) {
  ParsedRequest r;
  ASSERT_FALSE(parse(Endpoint::kCompletions, R"({"prompt": [1, 2, 3]})", &r));
  ASSERT_TRUE(r.prompt.token_ids.has_value());
  EXPECT_EQ(*r.prompt.token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.params.max_tokens, 16);  // OpenAI's completions default
  EXPECT_FALSE(r.max_tokens_given);
  EXPECT_EQ(r.params.n, 1);
  EXPECT_FALSE(r.seed_given);
  EXPECT_FALSE(r.params.logprobs.has_value());
  ParsedRequest c;
  ASSERT_FALSE(parse(Endpoint::kChat,
                     R"({"messages": [{"role": "user", "content": "hi"}],
                         "max_completion_tokens": 9, "stream": true,
                         "stream_options": {"include_usage": true},
                         "logprobs": true, "top_logprobs": 3})",
                     &c));
  EXPECT_EQ(c.params.max_tokens, 9);
  EXPECT_TRUE(c.stream);
  EXPECT_TRUE(c.include_usage);
  EXPECT_EQ(c.params.logprobs, 3);
  ASSERT_TRUE(c.prompt.chat_json.has_value());
  EXPECT_EQ(json::parse(c.prompt.chat_json->messages)[0]["content"], "hi");
  EXPECT_TRUE(c.prompt.chat_json->tools.empty());
  EXPECT_FALSE(c.parse_tool_calls);
}

TEST(OpenAiProtocol, ToolsAndTemplateFieldsReachTheChat) {
  ParsedRequest r;
  ASSERT_FALSE(parse(Endpoint::kChat,
                     R"({"messages": [{"role": "user", "content": "weather?"},
                                      {"role": "assistant", "content": null, "tool_calls": [
                                        {"id": "call_1", "type": "function", "function":
                                          {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}],
                         "tools": [{"type": "function", "function": {"name": "get_weather",
                                    "parameters": {"type": "object"}}}],
                         "chat_template_kwargs": {"enable_thinking": false}})",
                     &r));
  ASSERT_TRUE(r.prompt.chat_json.has_value());
  EXPECT_EQ(json::parse(r.prompt.chat_json->tools)[0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(r.prompt.chat_json->template_kwargs)["enable_thinking"], false);
  EXPECT_EQ(json::parse(r.prompt.chat_json->messages).size(), 3u);
  EXPECT_TRUE(r.parse_tool_calls);
  ParsedRequest none;
  ASSERT_FALSE(parse(Endpoint::kChat,
                     R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
                         "tools": [{"type": "function", "function": {"name": "f"}}]})",
                     &none));
  EXPECT_FALSE(none.parse_tool_calls);
}

TEST(OpenAiProtocol, EveryRefusalNamesItsField) {
  const Endpoint kC = Endpoint::kCompletions, kChat = Endpoint::kChat;
  EXPECT_EQ(refused_field(kC, R"({})"), "prompt");
  EXPECT_EQ(refused_field(kC, R"({"prompt": 5})"), "prompt");
  EXPECT_EQ(refused_field(kC, R"({"prompt": ["a", "b"]})"), "prompt");
  EXPECT_EQ(refused_field(kC, R"({"prompt": [1, -2]})"), "prompt");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "temperature": "hot"})"), "temperature");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "temperature": -1})"), "temperature");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "top_p": 1.5})"), "top_p");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "max_tokens": -1})"), "max_tokens");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "max_tokens": 1e12})"), "max_tokens");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "max_tokens": 4097})"), "max_tokens");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "max_tokens": 2.5})"), "max_tokens");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "n": 65})"), "n");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "n": 0})"), "n");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "logprobs": 21})"), "logprobs");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "echo": true})"), "echo");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "suffix": "y"})"), "suffix");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "best_of": 3})"), "best_of");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "stop": [1]})"), "stop");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "logit_bias": {"a": 1}})"), "logit_bias");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "logit_bias": {"1": 101}})"), "logit_bias");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "seed": "s"})"), "seed");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "frobnicate": 1})"), "frobnicate");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "stream_options": {"include_usage": true}})"),
            "stream_options");
  EXPECT_EQ(refused_field(kC, R"({"prompt": "x", "model": 3})"), "model");
  EXPECT_EQ(refused_field(kChat, R"({})"), "messages");
  EXPECT_EQ(refused_field(kChat, R"({"messages": []})"), "messages");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "wizard", "content": "x"}]})"),
            "messages[0].role");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"content": "x"}]})"), "messages[0].role");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "user"}]})"), "messages[0].content");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "user", "content": 7}]})"),
            "messages[0].content");
  EXPECT_EQ(refused_field(
                kChat, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"),
            "messages[0].content");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "user", "content": "x"}],
                                      "top_logprobs": 3})"),
            "top_logprobs");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "user", "content": "x"}],
                                      "logprobs": true, "top_logprobs": 21})"),
            "top_logprobs");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"type": "function"}]})"),
            "tools");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "user", "content": "x"}],
                                      "tool_choice": "required"})"),
            "tool_choice");
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "json_object"}})"),
            "response_format");
  // The ignored fields vLLM ignores too.
  EXPECT_EQ(refused_field(kChat, R"({"messages": [{"role": "user", "content": "x"}],
                                      "user": "u", "store": false, "parallel_tool_calls": true})"),
            "");
  ParsedRequest r;
  std::optional<ApiError> not_object = parse_request(kC, json::array(), limits(), &r);
  ASSERT_TRUE(not_object.has_value());
  EXPECT_EQ(not_object->status, 400);
}

TEST(OpenAiProtocol, ErrorBodyIsOpenAis) {
  const json body = error_body(ApiError{401, "no key", ""});
  EXPECT_EQ(body["error"]["message"], "no key");
  EXPECT_EQ(body["error"]["type"], "AuthenticationError");
  EXPECT_TRUE(body["error"]["param"].is_null());
  EXPECT_EQ(body["error"]["code"], 401);
  EXPECT_EQ(error_body(ApiError{400, "x: bad", "x"})["error"]["param"], "x");
  EXPECT_EQ(error_body(ApiError{413, "big", ""})["error"]["type"], "RequestTooLargeError");
  EXPECT_EQ(error_body(ApiError{429, "busy", ""})["error"]["type"], "RateLimitError");
}

api::CompletionOutput output(const std::string& text, int n_tokens, bool finished = false,
                             const std::string& reason = "") {
  api::CompletionOutput out;
  out.text = text;
  for (int i = 0; i < n_tokens; ++i) out.token_ids.push_back(100 + i);
  out.finished = finished;
  out.request_finished = finished;
  out.finish_reason = reason;
  return out;
}

TEST(OpenAiProtocol, ChatStreamCarriesReasoningContentAndToolCalls) {
  OutputParsing parsing;
  parsing.reasoning = true;
  parsing.tool_calls = true;
  int next_id = 0;
  parsing.make_tool_call_id = [&] { return "call_" + std::to_string(next_id++); };
  const std::vector<std::string> pieces = {
      "<think>",
      "\nplan it\n",
      "</think>\n\n",
      "Sure.",
      "\n<tool_",
      "call>\n{\"name\": \"get_",
      "weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"};
  ChoiceBuilder streamed(Endpoint::kChat, 0, parsing, false);
  int whole_next_id = 0;
  OutputParsing whole_parsing = parsing;
  whole_parsing.make_tool_call_id = [&] { return "call_" + std::to_string(whole_next_id++); };
  ChoiceBuilder whole(Endpoint::kChat, 0, whole_parsing, false);
  std::string reasoning, content, args;
  std::vector<json> chunks;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const bool last = i + 1 == pieces.size();
    api::CompletionOutput out = output(pieces[i], 1, last, last ? "stop" : "");
    whole.add(out);
    for (json& c : streamed.stream_choices(out)) chunks.push_back(std::move(c));
  }
  ASSERT_FALSE(chunks.empty());
  EXPECT_EQ(chunks.front()["delta"]["role"], "assistant");
  std::string name, id;
  for (const json& c : chunks) {
    const json& d = c["delta"];
    if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("content")) content += d["content"].get<std::string>();
    if (d.contains("tool_calls")) {
      for (const json& t : d["tool_calls"]) {
        EXPECT_EQ(t["index"], 0);
        if (t.contains("id")) id = t["id"];
        if (t["function"].contains("name")) name = t["function"]["name"];
        args += t["function"]["arguments"].get<std::string>();
      }
    }
  }
  EXPECT_EQ(reasoning, "\nplan it\n");
  EXPECT_EQ(content, "Sure.");
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(id, "call_0");
  EXPECT_EQ(json::parse(args), json::parse(R"({"city": "Oslo"})"));
  EXPECT_EQ(chunks.back()["finish_reason"], "tool_calls");
  EXPECT_EQ(streamed.finish_reason(), "tool_calls");

  const json w = whole.whole_choice();
  EXPECT_EQ(w["finish_reason"], "tool_calls");
  EXPECT_EQ(w["message"]["content"], "Sure.");
  EXPECT_EQ(w["message"]["reasoning_content"], "\nplan it\n");
  ASSERT_EQ(w["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(w["message"]["tool_calls"][0]["type"], "function");
  EXPECT_EQ(w["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(w["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Oslo"})"));
}

TEST(OpenAiProtocol, WithoutParsersTheTextIsContent) {
  ChoiceBuilder choice(Endpoint::kChat, 1, OutputParsing{}, false);
  const std::string text = "<think>x</think><tool_call>{\"name\": \"f\"}</tool_call>";
  choice.add(output(text, 3, true, "length"));
  const json w = choice.whole_choice();
  EXPECT_EQ(w["index"], 1);
  EXPECT_EQ(w["message"]["content"], text);
  EXPECT_FALSE(w["message"].contains("tool_calls"));
  EXPECT_FALSE(w["message"].contains("reasoning_content"));
  EXPECT_EQ(w["finish_reason"], "length");
}

TEST(OpenAiProtocol, LogprobsInBothShapes) {
  api::CompletionOutput out = output("ab", 2, true, "length");
  out.logprobs = {{7, "a", -0.5, 1, {{7, "a", -0.5}, {8, "b", -1.5}}},
                  {9, "b", -2.0, 2, {{3, "c", -1.0}, {9, "b", -2.0}}}};
  out.stop_string = "";
  ChoiceBuilder chat(Endpoint::kChat, 0, OutputParsing{}, true);
  chat.add(out);
  const json c = chat.whole_choice()["logprobs"]["content"];
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0]["token"], "a");
  EXPECT_DOUBLE_EQ(c[0]["logprob"].get<double>(), -0.5);
  EXPECT_EQ(c[0]["bytes"], json::array({97}));
  EXPECT_EQ(c[1]["top_logprobs"][0]["token"], "c");
  ChoiceBuilder completion(Endpoint::kCompletions, 0, OutputParsing{}, true);
  completion.add(out);
  const json l = completion.whole_choice()["logprobs"];
  EXPECT_EQ(l["tokens"], json::array({"a", "b"}));
  EXPECT_EQ(l["token_logprobs"], json::array({-0.5, -2.0}));
  EXPECT_DOUBLE_EQ(l["top_logprobs"][1]["c"].get<double>(), -1.0);
  EXPECT_EQ(l["text_offset"], json::array({0, 1}));
  // whole_choice() may be asked twice: the offsets do not move.
  EXPECT_EQ(completion.whole_choice()["logprobs"]["text_offset"], json::array({0, 1}));
}

TEST(OpenAiProtocol, StopReasonSaysWhatStopped) {
  ChoiceBuilder by_string(Endpoint::kCompletions, 0, OutputParsing{}, false);
  api::CompletionOutput a = output("x", 1, true, "stop");
  a.stop_string = "END";
  by_string.add(a);
  EXPECT_EQ(by_string.whole_choice()["stop_reason"], "END");
  ChoiceBuilder by_id(Endpoint::kCompletions, 0, OutputParsing{}, false);
  api::CompletionOutput b = output("x", 1, true, "stop");
  b.stop_token_id = 42;
  by_id.add(b);
  EXPECT_EQ(by_id.whole_choice()["stop_reason"], 42);
}

TEST(OpenAiProtocol, InvalidUtf8InOutputIsReplacedNotThrown) {
  json j = {{"text", std::string("a\xF0\x9F", 3)}};
  const std::string text = to_text(j);
  EXPECT_EQ(text, "{\"text\":\"a\xEF\xBF\xBD\"}") << text;
}

}  // namespace
}  // namespace e4kv::serve
