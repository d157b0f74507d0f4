// The output processor (engine/output.h) on the synthetic byte-level tokenizer, driven by hand-made
// engine updates: every byte below 0xC0 is its own token (id = byte), so a test spells its tokens
// as text and knows exactly what each step must release.
#include "engine/output.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "testing/synth_tokenizer.h"

namespace e4kv {
namespace {

class Output : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::string> json = make_synth_tokenizer_json(512);
    ASSERT_TRUE(json.ok()) << json.message();
    Result<Tokenizer> tok = Tokenizer::from_json(*json, "synth");
    ASSERT_TRUE(tok.ok()) << tok.message();
    tokenizer_ = std::make_unique<Tokenizer>(std::move(tok).value());
  }

  // One token per byte; checked against the tokenizer's own decode.
  std::vector<int32_t> byte_ids(const std::string& text) const {
    std::vector<int32_t> ids;
    for (unsigned char c : text) ids.push_back(c < 0xC0 ? int32_t(c) : int32_t(c) - 2);
    EXPECT_EQ(tokenizer_->decode(ids, true), text);
    return ids;
  }

  // Feeds `ids` one update per token; the last update finishes with `reason` (none: unfinished).
  // Returns each step's released text; stops early when the processor finishes the request.
  std::vector<std::string> feed(OutputProcessor& out, RequestId id, const std::vector<int32_t>& ids,
                                const std::string& reason = "", int32_t stop_token = -1) {
    std::vector<std::string> texts;
    for (size_t i = 0; i < ids.size(); ++i) {
      RequestUpdate u;
      u.id = id;
      u.new_tokens = {ids[i]};
      if (i + 1 == ids.size() && !reason.empty()) {
        u.finished = true;
        u.finish_reason = reason;
        u.stop_token = stop_token;
      }
      std::vector<RequestOutput> got = out.process(std::span<const RequestUpdate>(&u, 1), nullptr);
      EXPECT_EQ(got.size(), 1u);
      texts.push_back(got[0].new_text);
      last_ = got[0];
      if (got[0].finished) break;
    }
    return texts;
  }

  static std::string joined(const std::vector<std::string>& texts) {
    std::string all;
    for (const std::string& t : texts) all += t;
    return all;
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  RequestOutput last_;
};

// "lo w" begins in one token and ends three tokens later: each step releases only what can no
// longer start it.
TEST_F(Output, StopStringAcrossTokensIsHeldBackThenCut) {
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.stop = {"lo w"};
  out.add_request(7, params);
  const std::vector<std::string> texts = feed(out, 7, byte_ids("say hello world!"));
  const std::vector<std::string> want{"s", "a", "y", " ", "h", "e", "",
                                      "l",  // "ll": the first l can no longer start "lo w"
                                      "", "", ""};
  EXPECT_EQ(texts, want);
  EXPECT_TRUE(last_.finished);
  EXPECT_EQ(last_.finish_reason, "stop");
  EXPECT_EQ(last_.stop_string, "lo w");
  EXPECT_EQ(last_.new_tokens, byte_ids("w"));  // the token ids are all reported
  EXPECT_EQ(out.n_requests(), 0u);
}

TEST_F(Output, IncludeStopStrInOutputKeepsTheMatch) {
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.stop = {"lo w"};
  params.include_stop_str_in_output = true;
  out.add_request(1, params);
  EXPECT_EQ(joined(feed(out, 1, byte_ids("say hello world!"))), "say hello w");
  EXPECT_EQ(last_.finish_reason, "stop");
}

// A stop string that never completes: the held text is released when the next token rules it
// out, and what is held when the request ends is released with the end.
TEST_F(Output, AStopStringThatNeverCompletesReleasesEverything) {
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.stop = {"lo x", "!!"};
  out.add_request(1, params);
  std::vector<std::string> texts = feed(out, 1, byte_ids("hello world!"), "length");
  EXPECT_EQ(texts[2], "");      // "l" held
  EXPECT_EQ(texts[3], "l");     // "ll": the first cannot start "lo x"
  EXPECT_EQ(texts[4], "");      // "lo"
  EXPECT_EQ(texts[5], "");      // "lo "
  EXPECT_EQ(texts[6], "lo w");  // "lo w" is not "lo x"
  EXPECT_EQ(texts.back(), "!");  // held as the start of "!!", released by the end
  EXPECT_EQ(joined(texts), "hello world!");
  EXPECT_EQ(last_.finish_reason, "length");
  EXPECT_TRUE(last_.stop_string.empty());
}

TEST_F(Output, TheEarliestStopStringWins) {
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.stop = {"world", "o w", "hello"};  // "hello" ends first, before the others are seen
  out.add_request(1, params);
  EXPECT_EQ(joined(feed(out, 1, byte_ids("say hello world"))), "say ");
  EXPECT_EQ(last_.stop_string, "hello");
  OutputProcessor again(*tokenizer_);
  params.stop = {"world", "o w"};  // both match in one piece of text: "o w" starts first
  again.add_request(1, params);
  // One update of many tokens: the strings end in the same piece of text.
  RequestUpdate u;
  u.id = 1;
  u.new_tokens = byte_ids("say hello world");
  const std::vector<RequestOutput> got = again.process(std::span<const RequestUpdate>(&u, 1),
                                                       nullptr);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].new_text, "say hell");
  EXPECT_EQ(got[0].stop_string, "o w");
}

// Merged tokens of the real encoding: the stop string ends inside a token.
TEST_F(Output, StopStringInsideMergedTokens) {
  const std::vector<int32_t> ids = tokenizer_->encode("hello world, hello world", false);
  ASSERT_LT(ids.size(), std::string("hello world, hello world").size());  // merges happened
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.stop = {"ld, he"};
  out.add_request(3, params);
  EXPECT_EQ(joined(feed(out, 3, ids)), "hello wor");
  EXPECT_EQ(last_.finish_reason, "stop");
}

// A multi-byte character comes in two tokens; the stop string after it is cut whole.
TEST_F(Output, MultiByteTextAndStopString) {
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.stop = {"\xC3\xA9!"};  // "é!"
  out.add_request(1, params);
  const std::vector<std::string> texts = feed(out, 1, byte_ids("caf\xC3\xA9! ok"));
  EXPECT_EQ(joined(texts), "caf");
  EXPECT_EQ(last_.stop_string, "\xC3\xA9!");
  EXPECT_EQ(texts.size(), 6u);
}

// min_tokens: a stop string ending in one of the first min_tokens tokens is ordinary text.
TEST_F(Output, StopStringsWaitForMinTokens) {
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.stop = {"a"};
  params.min_tokens = 3;
  out.add_request(1, params);
  EXPECT_EQ(joined(feed(out, 1, byte_ids("bacada"))), "bac");
  EXPECT_EQ(last_.new_tokens, byte_ids("a"));
  EXPECT_EQ(last_.finish_reason, "stop");
}

// A stop or EOS id that ends the request leaves its own text out unless asked for.
TEST_F(Output, AStopTokenLeavesItsTextOut) {
  const std::vector<int32_t> ids = byte_ids("done!");
  for (bool include : {false, true}) {
    OutputProcessor out(*tokenizer_);
    RequestParams params;
    params.include_stop_str_in_output = include;
    out.add_request(1, params);
    EXPECT_EQ(joined(feed(out, 1, ids, "stop", ids.back())), include ? "done!" : "done");
    EXPECT_EQ(last_.finish_reason, "stop");
    EXPECT_EQ(last_.stop_token, ids.back());
    EXPECT_TRUE(last_.stop_string.empty());
  }
  // A special token (EOS) is skipped by the decoder anyway.
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.include_stop_str_in_output = true;
  out.add_request(1, params);
  const int32_t eos = *tokenizer_->token_to_id("<|endoftext|>");
  std::vector<int32_t> with_eos = byte_ids("ok");
  with_eos.push_back(eos);
  EXPECT_EQ(joined(feed(out, 1, with_eos, "stop", eos)), "ok");
}

TEST_F(Output, AbortAndErrorsAndUnknownRequests) {
  OutputProcessor out(*tokenizer_);
  RequestParams params;
  params.stop = {"xyz"};
  out.add_request(1, params);
  out.add_request(2, params);
  feed(out, 1, byte_ids("abx"));
  std::vector<RequestOutput> aborted = out.abort(1, nullptr);
  ASSERT_EQ(aborted.size(), 1u);
  EXPECT_EQ(aborted[0].finish_reason, "abort");
  EXPECT_TRUE(aborted[0].request_finished);
  EXPECT_TRUE(aborted[0].new_text.empty());  // the held "x" is dropped with the request
  EXPECT_TRUE(out.abort(1, nullptr).empty());
  // An error finishes with its message, the held text released.
  RequestUpdate u;
  u.id = 2;
  u.new_tokens = byte_ids("x");
  u.finished = true;
  u.finish_reason = "error";
  u.error = "boom";
  std::vector<RequestOutput> got = out.process(std::span<const RequestUpdate>(&u, 1), nullptr);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].finish_reason, "error");
  EXPECT_EQ(got[0].error, "boom");
  EXPECT_EQ(got[0].new_text, "x");
  EXPECT_EQ(out.n_requests(), 0u);
  // Never added: passed through without text.
  u.id = 9;
  got = out.process(std::span<const RequestUpdate>(&u, 1), nullptr);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].new_tokens, u.new_tokens);
  EXPECT_TRUE(got[0].new_text.empty());
}

}  // namespace
}  // namespace e4kv
