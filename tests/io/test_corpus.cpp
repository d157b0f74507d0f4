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
           Case{"{\"messages\": [{\"content\": \"x\"}]}", "\"messages\"[0] must be an object"},
           Case{"\n\n", "no documents"},
       }) {
    Result<std::vector<CorpusDocument>> docs = parse_corpus(c.text, "c.jsonl");
    ASSERT_FALSE(docs.ok()) << c.text;
    EXPECT_NE(docs.message().find(c.expect), std::string::npos) << docs.message();
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
