// Corpus files (io/corpus.h): the three document kinds, blank lines, and an error naming the line
// for each kind of bad input; --shard parsing and selection.
#include <gtest/gtest.h>

#include <string>

#include "io/corpus.h"

namespace e4kv {
namespace {

TEST(Corpus, ParsesTheThreeKindsAndSkipsBlankLines) {
  const std::string text =
      "{\"text\": \"hello\", \"id\": \"a\"}\n"
      "\n"
      "{\"token_ids\": [1, 2, 3]}\r\n"
      "   \n"
      "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}";
  Result<std::vector<CorpusDocument>> docs = parse_corpus(text, "c.jsonl");
  ASSERT_TRUE(docs.ok()) << docs.message();
  ASSERT_EQ(docs->size(), 3u);
  EXPECT_EQ((*docs)[0].kind, CorpusKind::kText);
  EXPECT_EQ((*docs)[0].text, "hello");
  EXPECT_EQ((*docs)[0].line, 1);
  EXPECT_EQ((*docs)[1].kind, CorpusKind::kTokenIds);
  EXPECT_EQ((*docs)[1].token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ((*docs)[1].line, 3);
  EXPECT_EQ((*docs)[2].kind, CorpusKind::kMessages);
  EXPECT_EQ((*docs)[2].messages[0]["content"], "hi");
  EXPECT_EQ((*docs)[2].line, 5);
}

TEST(Corpus, ErrorsNameTheLineAndTheProblem) {
  struct Case {
    const char* text;
    const char* expect;
  };
  for (const Case& c : {
           Case{"{\"text\": \"a\"}\n{\"text\": ", "c.jsonl:2: invalid JSON"},
           Case{"[1, 2]", "c.jsonl:1: expected a JSON object"},
           Case{"{\"id\": 1}", "c.jsonl:1: none of"},
           Case{"{\"text\": \"a\", \"token_ids\": [1]}", "c.jsonl:1: more than one of"},
           Case{"{\"text\": 5}", "\"text\" must be a string"},
           Case{"{\"text\": \"\"}", "\"text\" is empty"},
           Case{"{\"token_ids\": [1, -2]}", "\"token_ids\"[1] is -2"},
           Case{"{\"token_ids\": [1.5]}", "\"token_ids\"[0] is 1.5"},
           Case{"{\"token_ids\": []}", "non-empty array"},
           Case{"{\"messages\": [{\"content\": \"x\"}]}",
                "c.jsonl:1: messages[0].role: expected a string (system, user, assistant or tool), "
                "got nothing"},
           Case{"\n\n", "no documents"},
       }) {
    Result<std::vector<CorpusDocument>> docs = parse_corpus(c.text, "c.jsonl");
    ASSERT_FALSE(docs.ok()) << c.text;
    EXPECT_NE(docs.message().find(c.expect), std::string::npos) << docs.message();
  }
}

// A {"messages"} document gets only what chat templates are written for; each refusal names the
// line and the field.
TEST(Corpus, MessagesAreChecked) {
  const std::string user = R"({"role": "user", "content": "hi"})";
  auto doc = [&](const std::string& message) {
    return "{\"text\": \"first line\"}\n{\"messages\": [" + user + ", " + message + "]}";
  };
  const std::string call = R"({"type": "function", "function": {"name": "f", "arguments": "{}"}})";
  struct Case {
    std::string message;
    std::string expect;
  };
  for (const Case& c : {
           Case{R"({"role": "boss", "content": "x"})",
                R"(c.jsonl:2: messages[1].role: unknown role "boss" (expected system, user, )"
                R"(assistant or tool))"},
           Case{R"({"role": "User", "content": "x"})", R"(messages[1].role: unknown role "User")"},
           Case{R"({"role": 3, "content": "x"})", "messages[1].role: expected a string"},
           Case{R"("just text")", "messages[1]: expected a message object"},
           Case{R"({"role": "user", "content": 42})",
                "messages[1].content: expected a string, got number"},
           Case{R"({"role": "user", "content": {"text": "x"}})",
                "messages[1].content: expected a string, got object"},
           Case{R"({"role": "user", "content": [{"type": "text", "text": "x"}]})",
                "messages[1].content: expected a string, got array"},
           Case{R"({"role": "user", "content": null})",
                "messages[1].content: expected a string, got null (only an assistant message "
                "with tool_calls may leave it out)"},
           Case{R"({"role": "assistant"})", "messages[1].content: expected a string, got nothing"},
           Case{R"({"role": "user", "content": "x", "tool_calls": [)" + call + "]}",
                "messages[1].tool_calls: only an assistant message makes tool calls, not a user "
                "message"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": {"name": "f"}})",
                "messages[1].tool_calls: expected an array of tool calls, got object"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": ["f"]})",
                "messages[1].tool_calls[0]: expected a tool call object, got string"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": [{"function": )"
                R"({"name": "f", "arguments": "{}"}}]})",
                R"(messages[1].tool_calls[0].type: expected "function", got nothing)"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": [{"type": "code", )"
                R"("function": {"name": "f", "arguments": "{}"}}]})",
                R"(messages[1].tool_calls[0].type: expected "function", got "code")"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": [{"type": "function"}]})",
                "messages[1].tool_calls[0].function: expected an object"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": [{"type": "function", )"
                R"("function": {"arguments": "{}"}}]})",
                "messages[1].tool_calls[0].function.name: expected a string, got nothing"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": [{"type": "function", )"
                R"("function": {"name": "f", "arguments": [1]}}]})",
                "messages[1].tool_calls[0].function.arguments: expected a string or an object, "
                "got array"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": [{"type": "function", )"
                R"("function": {"name": "f"}}]})",
                "messages[1].tool_calls[0].function.arguments: expected a string or an object, "
                "got nothing"},
           Case{R"({"role": "assistant", "content": null, "tool_calls": [{"type": "function", )"
                R"("id": 7, "function": {"name": "f", "arguments": "{}"}}]})",
                "messages[1].tool_calls[0].id: expected a string, got number"},
           Case{R"({"role": "tool", "content": "x", "tool_call_id": 7})",
                "messages[1].tool_call_id: expected a string, got number"},
           Case{R"({"role": "user", "content": "x", "name": ["a"]})",
                "messages[1].name: expected a string, got array"},
       }) {
    Result<std::vector<CorpusDocument>> docs = parse_corpus(doc(c.message), "c.jsonl");
    ASSERT_FALSE(docs.ok()) << c.message;
    EXPECT_NE(docs.message().find(c.expect), std::string::npos)
        << "got: " << docs.message() << "\nexpected: " << c.expect;
    EXPECT_EQ(docs.message().rfind("c.jsonl:2: ", 0), 0u) << docs.message();
  }

  // What the templates are written for is accepted: tool calls with null, empty or absent
  // content, arguments as a string or an object, ids, names, a tool's answer.
  for (const std::string& message : {
           std::string(R"({"role": "system", "content": ""})"),
           std::string(R"({"role": "assistant", "content": "ok", "reasoning_content": "hm"})"),
           R"({"role": "assistant", "content": null, "tool_calls": [)" + call + "]}",
           R"({"role": "assistant", "tool_calls": [)" + call + "]}",
           std::string(R"({"role": "assistant", "content": "", "tool_calls": [{"type": )"
                       R"("function", "id": "c1", "function": {"name": "f", "arguments": )"
                       R"({"a": [1, {"b": null}]}}}]})"),
           std::string(R"({"role": "assistant", "content": "x", "tool_calls": []})"),
           std::string(R"({"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"})"),
           std::string(R"({"role": "user", "content": "x", "name": null, "extra": {"k": 1}})"),
       }) {
    Result<std::vector<CorpusDocument>> docs = parse_corpus(doc(message), "c.jsonl");
    EXPECT_TRUE(docs.ok()) << message << ": " << docs.message();
  }
}

TEST(Corpus, ShardsSplitDocumentsRoundRobin) {
  Result<CorpusShard> shard = parse_corpus_shard("1/3");
  ASSERT_TRUE(shard.ok());
  EXPECT_EQ(shard->index, 1);
  EXPECT_EQ(shard->count, 3);
  for (const char* bad : {"3/3", "-1/2", "1", "a/b", "1/0", "1/2x", ""}) {
    EXPECT_FALSE(parse_corpus_shard(bad).ok()) << bad;
  }
  std::vector<CorpusDocument> docs(7);
  for (int i = 0; i < 7; ++i) docs[size_t(i)].line = i + 1;
  const std::vector<CorpusDocument> mine = select_shard(docs, *shard);
  ASSERT_EQ(mine.size(), 2u);
  EXPECT_EQ(mine[0].line, 2);
  EXPECT_EQ(mine[1].line, 5);
}

}  // namespace
}  // namespace e4kv
