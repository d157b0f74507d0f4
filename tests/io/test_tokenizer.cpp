// The tokenizer on small hand-built tokenizer.json files whose encodings are derived by hand in
// the comments: BPE merge order, ignore_merges, added tokens (lstrip / rstrip / single_word),
// byte fallback, Metaspace, Split behaviors, post-processors, tokenizer_config.json, errors that
// name the field, the streaming decoder against decode(), and round trips.
#include "io/tokenizer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/files.h"
#include "testing/synth_tokenizer.h"

namespace e4kv {
namespace {

using json = nlohmann::json;
using testing_support::TempDir;
using testing_support::write_text;
using Ids = std::vector<int32_t>;

// GPT-2's byte-level character for byte `b` (printable bytes stand for themselves, the others
// take U+0100 on in byte order), computed here independently of the library.
std::string byte_char(int b) {
  int cp = b;
  if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
    cp = 256;
    for (int k = 0; k < b; ++k) {
      if (!((k >= 0x21 && k <= 0x7E) || (k >= 0xA1 && k <= 0xAC) || k >= 0xAE)) ++cp;
    }
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

bool valid_utf8(const std::string& text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto b = static_cast<uint8_t>(text[i]);
    size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > text.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<uint8_t>(text[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// A byte-level BPE (ids 0..255: the bytes' characters; then one id per merge, in order) with a
// GPT-2 ByteLevel pre-tokenizer (use_regex) and decoder.
json byte_level_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  json merge_list = json::array();
  int next_id = 256;
  for (const auto& [left, right] : merges) {
    if (!vocab.contains(left + right)) vocab[left + right] = next_id++;
    merge_list.push_back({left, right});
  }
  return {
      {"version", "1.0"},
      {"added_tokens", json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}}};
}

// Merges (ranks 0..4): h+e, Ġ+t, Ġt+he, l+l, e+ll -> ids 256..260.
json gpt2_like() {
  return byte_level_tokenizer({{"h", "e"}, {"Ġ", "t"}, {"Ġt", "he"}, {"l", "l"}, {"e", "ll"}});
}

json added_token(int id, const std::string& content, bool special) {
  return {{"id", id},        {"content", content},     {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", !special}, {"special", special}};
}

Tokenizer load(const json& j) {
  Result<Tokenizer> tokenizer = Tokenizer::from_json(j.dump(), "test/tokenizer.json");
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.message();
  if (!tokenizer.ok()) std::abort();
  return std::move(tokenizer).value();
}

std::string load_error(const json& j) {
  Result<Tokenizer> tokenizer = Tokenizer::from_json(j.dump(), "test/tokenizer.json");
  EXPECT_FALSE(tokenizer.ok());
  return tokenizer.ok() ? std::string() : tokenizer.message();
}

// SentencePiece-style (Llama-2): Prepend("▁") + Replace(" " -> "▁") normalizer, no pre-tokenizer,
// byte fallback, decoder Replace / ByteFallback / Fuse / Strip, a BOS template.
// Ids: <unk> 0, <s> 1, </s> 2, <0x00>..<0xFF> 3..258, then ▁ 259, h 260, i 261, ▁h 262, ▁hi 263.
json sentencepiece_like() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  vocab["▁"] = 259;
  vocab["h"] = 260;
  vocab["i"] = 261;
  vocab["▁h"] = 262;
  vocab["▁hi"] = 263;
  return {
      {"added_tokens",
       {added_token(0, "<unk>", true), added_token(1, "<s>", true), added_token(2, "</s>", true)}},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "▁"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair", json::array()},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", {"▁ h", "▁h i"}}}}};
}

// Metaspace pre-tokenizer and decoder (newer Mistral / Llama conversions).
// Ids: <unk> 0, <s> 1, </s> 2, ▁ 3, h 4, i 5, ▁h 6, ▁hi 7, hi 8; merges ▁+h, ▁h+i, h+i.
json metaspace_like(const std::string& scheme, bool split) {
  json metaspace = {
      {"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", scheme}, {"split", split}};
  return {
      {"added_tokens",
       {added_token(0, "<unk>", true), added_token(1, "<s>", true), added_token(2, "</s>", true)}},
      {"normalizer", nullptr},
      {"pre_tokenizer", metaspace},
      {"decoder", metaspace},
      {"model",
       {{"type", "BPE"},
        {"unk_token", "<unk>"},
        {"vocab",
         {{"<unk>", 0},
          {"<s>", 1},
          {"</s>", 2},
          {"▁", 3},
          {"h", 4},
          {"i", 5},
          {"▁h", 6},
          {"▁hi", 7},
          {"hi", 8}}},
        {"merges", json::array({json::array({"▁", "h"}), json::array({"▁h", "i"}),
                                json::array({"h", "i"})})}}}};
}

TEST(Tokenizer, ByteLevelAlphabetIsGpt2s) {
  const Tokenizer tok = load(gpt2_like());
  EXPECT_EQ(tok.vocab_size(), 261);
  EXPECT_EQ(tok.token_to_id("Ġ"), 32);    // space
  EXPECT_EQ(tok.token_to_id("Ċ"), 10);    // newline
  EXPECT_EQ(tok.token_to_id("ĉ"), 9);     // tab
  EXPECT_EQ(tok.token_to_id("Ā"), 0);     // NUL takes U+0100
  EXPECT_EQ(tok.token_to_id("ġ"), 127);   // DEL, the 34th byte outside the printable ranges
  EXPECT_EQ(tok.token_to_id("ł"), 0xA0);  // no-break space
  EXPECT_EQ(tok.token_to_id("Ń"), 0xAD);  // soft hyphen, the last one
  EXPECT_EQ(tok.id_to_token(256), "he");
  for (int b = 0; b < 128; ++b) {
    const Ids id{b};
    EXPECT_EQ(tok.decode(id, false), std::string(1, static_cast<char>(b))) << b;
  }
  // Three byte tokens that together are one character.
  EXPECT_EQ(tok.decode(Ids{0xE4, 0xB8, 0xAD}, false), "中");
  // A lone continuation byte and a truncated sequence each decode to one U+FFFD.
  EXPECT_EQ(tok.decode(Ids{0x80, 'a', 0xE4, 0xB8}, false),
            "\xEF\xBF\xBD"
            "a\xEF\xBF\xBD");
}

TEST(Tokenizer, BpeMergesLowestRankFirst) {
  const Tokenizer tok = load(gpt2_like());
  // Pre-tokens "the", " the", " hello" (GPT-2 regex), mapped to "the", "Ġthe", "Ġhello".
  // "the": h+e (rank 0) -> t he.
  // "Ġthe": h+e (0) -> Ġ t he; Ġ+t (1) -> Ġt he; Ġt+he (2) -> Ġthe.
  // "Ġhello": h+e (0) -> Ġ he l l o; l+l (3) -> Ġ he ll o; e+ll (4) never applies.
  EXPECT_EQ(tok.encode("the the hello", false), (Ids{'t', 256, 258, 32, 256, 259, 'o'}));
  EXPECT_EQ(tok.decode(tok.encode("the the hello", false), false), "the the hello");
  // Ties go to the leftmost pair: l l l -> ll l.
  EXPECT_EQ(tok.encode("lll", false), (Ids{259, 'l'}));
  // "ell": e+ll needs ll first: e l l -> e ll -> ell.
  EXPECT_EQ(tok.encode("ell", false), (Ids{260}));
}

TEST(Tokenizer, MergesAsStringsEqualMergesAsPairs) {
  json j = gpt2_like();
  json strings = json::array();
  for (const json& pair : j["model"]["merges"]) {
    strings.push_back(pair[0].get<std::string>() + " " + pair[1].get<std::string>());
  }
  j["model"]["merges"] = strings;
  EXPECT_EQ(load(j).encode("the the hello lll", false),
            load(gpt2_like()).encode("the the hello lll", false));
}

TEST(Tokenizer, IgnoreMergesTakesWholeWordsFromTheVocab) {
  json j = gpt2_like();
  j["model"]["vocab"]["hello"] = 261;  // no merge leads to it
  EXPECT_EQ(load(j).encode("hello", false), (Ids{256, 259, 'o'}));
  j["model"]["ignore_merges"] = true;
  const Tokenizer tok = load(j);
  EXPECT_EQ(tok.encode("hello", false), (Ids{261}));
  // Pre-tokens that are not in the vocabulary still merge.
  EXPECT_EQ(tok.encode("hello the", false), (Ids{261, 258}));
}

TEST(Tokenizer, AddedTokensWithLstripRstrip) {
  json j = gpt2_like();
  j["added_tokens"] = {added_token(300, "<|endoftext|>", true), added_token(301, "<tool>", false)};
  j["added_tokens"][1]["lstrip"] = true;
  j["added_tokens"][1]["rstrip"] = true;
  const Tokenizer tok = load(j);
  EXPECT_EQ(tok.vocab_size(), 302);
  // "<tool>" takes the spaces on both sides: pieces "hi", <tool>, "there", <|endoftext|>;
  // "there": h+e -> t he r e.
  const Ids ids = tok.encode("hi <tool> there<|endoftext|>", false);
  EXPECT_EQ(ids, (Ids{'h', 'i', 301, 't', 256, 'r', 'e', 300}));
  EXPECT_EQ(tok.decode(ids, false), "hi<tool>there<|endoftext|>");
  EXPECT_EQ(tok.decode(ids, true), "hi<tool>there");  // <tool> is not special
  EXPECT_TRUE(tok.is_special(300));
  EXPECT_FALSE(tok.is_special(301));
  EXPECT_FALSE(tok.is_special('h'));
  EXPECT_EQ(tok.token_to_id("<tool>"), 301);
  EXPECT_EQ(tok.id_to_token(300), "<|endoftext|>");
  // Longest match first.
  j["added_tokens"].push_back(added_token(302, "<|endoftext|>x", true));
  EXPECT_EQ(load(j).encode("<|endoftext|>x<|endoftext|>", false), (Ids{302, 300}));
}

// encode(text, ..., plain): special added tokens match only outside the plain ranges; inside,
// their text is encoded as a tokenizer without them encodes it (the independent truth here:
// the same tokenizer with the special token removed); non-special added tokens still match.
TEST(Tokenizer, PlainRangesEncodeSpecialTokenTextAsText) {
  json j = gpt2_like();
  j["added_tokens"] = {added_token(300, "<|endoftext|>", true), added_token(301, "<tool>", false),
                       added_token(302, "<|endoftext|>x", true)};
  const Tokenizer tok = load(j);
  json without = gpt2_like();
  without["added_tokens"] = {added_token(301, "<tool>", false)};
  const Tokenizer as_text = load(without);

  const std::string eot = "<|endoftext|>";
  const std::string inner = "y" + eot + "<tool>z" + eot;
  const std::string text = eot + inner + eot;
  const PlainRanges plain = {{eot.size(), eot.size() + inner.size()}};
  Ids want = {300};
  const Ids middle = as_text.encode(inner, false);
  want.insert(want.end(), middle.begin(), middle.end());
  want.push_back(300);
  EXPECT_EQ(tok.encode(text, false, plain), want);
  EXPECT_NE(std::find(middle.begin(), middle.end(), 301), middle.end());  // <tool> matched
  EXPECT_EQ(std::count(middle.begin(), middle.end(), 300), 0);
  // Without ranges: what encode() gives.
  EXPECT_EQ(tok.encode(text, false, {}), tok.encode(text, false));
  EXPECT_EQ(tok.encode(text, false), (Ids{300, 'y', 300, 301, 'z', 300, 300}));
  // A range that covers one byte of a special token's text keeps the whole token text.
  EXPECT_EQ(tok.encode(eot, false, {{eot.size() - 1, eot.size()}}), as_text.encode(eot, false));
  EXPECT_EQ(tok.encode(eot, false, {{0, 1}}), as_text.encode(eot, false));
  EXPECT_EQ(tok.encode(" " + eot, false, {{0, 1}}), (Ids{' ', 300}));
  // The longest token that may match wins: "<|endoftext|>x" touches the range, "<|endoftext|>"
  // does not.
  EXPECT_EQ(tok.encode(eot + "x", false), (Ids{302}));
  EXPECT_EQ(tok.encode(eot + "x", false, {{eot.size(), eot.size() + 1}}), (Ids{300, 'x'}));
  // add_special_tokens still adds the post-processor's tokens.
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair", json::array()},
      {"special_tokens",
       {{"<|endoftext|>",
         {{"id", "<|endoftext|>"}, {"ids", {300}}, {"tokens", {"<|endoftext|>"}}}}}}};
  const Ids with_bos = load(j).encode(eot, true, {{0, eot.size()}});
  Ids want_bos = {300};
  const Ids eot_text = as_text.encode(eot, false);
  want_bos.insert(want_bos.end(), eot_text.begin(), eot_text.end());
  EXPECT_EQ(with_bos, want_bos);
}

// Invalid UTF-8 is repaired before matching; the ranges follow the bytes they covered.
TEST(Tokenizer, PlainRangesFollowRepairedUtf8) {
  json j = gpt2_like();
  j["added_tokens"] = {added_token(300, "<|endoftext|>", true)};
  const Tokenizer tok = load(j);
  const std::string eot = "<|endoftext|>";
  const std::string text = "\xFF" + eot + "\xE4\xB8" + eot;
  const Ids repaired = tok.encode("\xEF\xBF\xBD" + eot + "\xEF\xBF\xBD" + eot, false);
  EXPECT_EQ(tok.encode(text, false), repaired);
  // The first special token's text is plain, the second is not.
  const Ids got = tok.encode(text, false, {{0, 1 + eot.size()}});
  EXPECT_EQ(std::count(got.begin(), got.end(), 300), 1);
  EXPECT_EQ(got.back(), 300);
  EXPECT_EQ(tok.decode(got, false), "\xEF\xBF\xBD" + eot + "\xEF\xBF\xBD" + eot);
  // The invalid byte alone plain: both special tokens match.
  EXPECT_EQ(tok.encode(text, false, {{0, 1}}), repaired);
}

// A special token matched after normalization (normalized: true, rare in real tokenizers): the
// ranges are carried over to the normalized text. Here Prepend("▁") + Replace(" " -> "▁") and a
// special "[INST]" whose normalized form is "▁[INST]".
TEST(Tokenizer, PlainRangesCarryOverToNormalizedSpecialTokens) {
  json j = sentencepiece_like();
  json inst = added_token(264, "[INST]", true);
  inst["normalized"] = true;
  j["added_tokens"].push_back(inst);
  j["model"]["vocab"]["[INST]"] = 264;
  const Tokenizer tok = load(j);
  const std::string text = "[INST] hi [INST]";
  // "▁[INST]", "▁hi", "▁[INST]".
  EXPECT_EQ(tok.encode(text, false), (Ids{264, 263, 264}));
  // Bytes of "[INST]" by byte fallback: '[' 0x5B, I 0x49, N 0x4E, S 0x53, T 0x54, ']' 0x5D, each
  // 3 + the byte.
  const Ids inst_bytes = {3 + 0x5B, 3 + 0x49, 3 + 0x4E, 3 + 0x53, 3 + 0x54, 3 + 0x5D};
  // " hi [INST]" plain: the second marker is "▁" and its bytes.
  Ids want = {264, 263, 259};
  want.insert(want.end(), inst_bytes.begin(), inst_bytes.end());
  EXPECT_EQ(tok.encode(text, false, {{6, text.size()}}), want);
  // The first "[INST]" plain: "▁" and its bytes, "▁hi", then the second marker.
  want = {259};
  want.insert(want.end(), inst_bytes.begin(), inst_bytes.end());
  want.push_back(263);
  want.push_back(264);
  EXPECT_EQ(tok.encode(text, false, {{0, 6}}), want);
  // Only " hi " plain: both markers match.
  EXPECT_EQ(tok.encode(text, false, {{6, 10}}), (Ids{264, 263, 264}));
}

TEST(Tokenizer, SingleWordAddedTokensDoNotMatchInsideWords) {
  json j = gpt2_like();
  j["added_tokens"] = {added_token(302, "ab", false)};
  j["added_tokens"][0]["single_word"] = true;
  // "ab" at 0 is a word; "ab" in "cab" touches 'c' and is skipped; the last "ab" is a word.
  // Between them " cab " -> "Ġcab", "Ġ".
  EXPECT_EQ(load(j).encode("ab cab ab", false), (Ids{302, 32, 'c', 'a', 'b', 32, 302}));
}

TEST(Tokenizer, ByteFallbackSentencePieceStyle) {
  const Tokenizer tok = load(sentencepiece_like());
  // Normalized "▁hi▁中": ▁+h, then ▁h+i; "中" is not in the vocabulary: its bytes E4 B8 AD.
  const Ids ids = tok.encode("hi 中", false);
  EXPECT_EQ(ids, (Ids{263, 259, 3 + 0xE4, 3 + 0xB8, 3 + 0xAD}));
  const Ids with_bos = tok.encode("hi 中", true);
  EXPECT_EQ(with_bos, (Ids{1, 263, 259, 3 + 0xE4, 3 + 0xB8, 3 + 0xAD}));
  EXPECT_EQ(tok.decode(with_bos, false), "<s> hi 中");
  EXPECT_EQ(tok.decode(with_bos, true), "hi 中");
  // Byte tokens that do not form UTF-8 become one U+FFFD each.
  EXPECT_EQ(tok.decode(Ids{263, 3 + 0xE4, 3 + 0xB8, 260}, true), "hi\xEF\xBF\xBD\xEF\xBF\xBDh");
  // Special tokens in the text are matched before normalization; each piece gets its "▁".
  EXPECT_EQ(tok.encode("hi</s>hi", false), (Ids{263, 2, 263}));
}

TEST(Tokenizer, UnknownCharactersFuseIntoOneUnk) {
  json j = sentencepiece_like();
  j["model"]["byte_fallback"] = false;
  // "▁hi中中x": 中, 中 and x are unknown.
  EXPECT_EQ(load(j).encode("hi中中x", false), (Ids{263, 0}));
  j["model"]["fuse_unk"] = false;
  EXPECT_EQ(load(j).encode("hi中中x", false), (Ids{263, 0, 0, 0}));
  j["model"]["unk_token"] = nullptr;  // without an unk token they are dropped
  EXPECT_EQ(load(j).encode("hi中中x", false), (Ids{263}));
}

TEST(Tokenizer, ByteFallbackRoundTrip) {
  const Tokenizer tok = load(sentencepiece_like());
  for (const std::string text :
       {"hi", "  two leading spaces", "Grüße, 世界! 👩🏽‍💻 e\u0301",
        "tab\there\nnew line", "trailing  ", ""}) {
    EXPECT_EQ(tok.decode(tok.encode(text, true), true), text) << text;
  }
}

TEST(Tokenizer, MetaspacePrependSchemes) {
  // "first": only the piece at the start of the input gets "▁"; split false keeps one piece.
  const Tokenizer first = load(metaspace_like("first", false));
  EXPECT_EQ(first.encode("hi<s>hi", false), (Ids{7, 1, 8}));
  EXPECT_EQ(first.decode(Ids{7, 1, 8}, false), "hi<s>hi");
  EXPECT_EQ(first.decode(Ids{7, 1, 8}, true), "hihi");
  // "▁hi▁hi" as one piece: ▁+h at 0 and 3, then ▁h+i twice.
  EXPECT_EQ(first.encode("hi hi", false), (Ids{7, 7}));
  EXPECT_EQ(first.decode(Ids{7, 7}, false), "hi hi");

  const Tokenizer always = load(metaspace_like("always", true));
  EXPECT_EQ(always.encode("hi<s>hi", false), (Ids{7, 1, 7}));
  // The Metaspace decoder drops every "▁" of the first token only.
  EXPECT_EQ(always.decode(Ids{3, 7, 7}, false), " hi hi");

  const Tokenizer never = load(metaspace_like("never", true));
  EXPECT_EQ(never.encode("hi hi", false), (Ids{8, 7}));
  EXPECT_EQ(never.decode(Ids{8, 7}, false), "hi hi");
}

// A tokenizer whose vocabulary holds the pieces a Split makes (ignore_merges gives one id per
// piece), so the ids show where it cut. Ids: a 0, b 1, - 2, a- 3, -b 4, -- 5, 1 6, 2 7, 3 8,
// 123 9.
json piece_revealing(const json& pre_tokenizer) {
  return {{"pre_tokenizer", pre_tokenizer},
          {"model",
           {{"type", "BPE"},
            {"ignore_merges", true},
            {"vocab",
             {{"a", 0},
              {"b", 1},
              {"-", 2},
              {"a-", 3},
              {"-b", 4},
              {"--", 5},
              {"1", 6},
              {"2", 7},
              {"3", 8},
              {"123", 9}}},
            {"merges", json::array()}}}};
}

TEST(Tokenizer, SplitBehaviors) {
  auto split = [](const std::string& behavior, bool invert, const json& pattern) {
    return load(piece_revealing(
        {{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}}));
  };
  const json dash = {{"String", "-"}};
  EXPECT_EQ(split("Removed", false, dash).encode("a-b", false), (Ids{0, 1}));
  EXPECT_EQ(split("Isolated", false, dash).encode("a-b", false), (Ids{0, 2, 1}));
  EXPECT_EQ(split("MergedWithPrevious", false, dash).encode("a-b", false), (Ids{3, 1}));
  EXPECT_EQ(split("MergedWithNext", false, dash).encode("a-b", false), (Ids{0, 4}));
  EXPECT_EQ(split("Isolated", false, dash).encode("a--b", false), (Ids{0, 2, 2, 1}));
  EXPECT_EQ(split("Contiguous", false, dash).encode("a--b", false), (Ids{0, 5, 1}));
  // Inverted: the letters are the matches, so Removed drops the dash.
  EXPECT_EQ(split("Removed", true, {{"Regex", "[a-z]+"}}).encode("a-b", false), (Ids{0, 1}));
}

TEST(Tokenizer, DigitsPreTokenizer) {
  EXPECT_EQ(load(piece_revealing({{"type", "Digits"}, {"individual_digits", true}}))
                .encode("a123", false),
            (Ids{0, 6, 7, 8}));
  EXPECT_EQ(load(piece_revealing({{"type", "Digits"}, {"individual_digits", false}}))
                .encode("a123", false),
            (Ids{0, 9}));
}

TEST(Tokenizer, ByteLevelAddPrefixSpace) {
  json j = gpt2_like();
  j["pre_tokenizer"]["add_prefix_space"] = true;
  // "the" -> " the" -> Ġthe.
  EXPECT_EQ(load(j).encode("the", false), (Ids{258}));
}

TEST(Tokenizer, PostProcessors) {
  json j = gpt2_like();
  j["added_tokens"] = {added_token(300, "<bos>", true), added_token(301, "<eos>", true)};
  j["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       {{{"type", "ByteLevel"}, {"trim_offsets", false}},
        {{"type", "TemplateProcessing"},
         {"single",
          {{{"SpecialToken", {{"id", "<bos>"}, {"type_id", 0}}}},
           {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
           {{"SpecialToken", {{"id", "<eos>"}, {"type_id", 0}}}}}},
         {"special_tokens",
          {{"<bos>", {{"id", "<bos>"}, {"ids", {300}}, {"tokens", {"<bos>"}}}},
           {"<eos>", {{"id", "<eos>"}, {"ids", {301}}, {"tokens", {"<eos>"}}}}}}}}}};
  const Tokenizer tok = load(j);
  EXPECT_EQ(tok.encode("the", true), (Ids{300, 't', 256, 301}));
  EXPECT_EQ(tok.encode("the", false), (Ids{'t', 256}));
  EXPECT_EQ(tok.encode("", true), (Ids{300, 301}));

  j["post_processor"] = {
      {"type", "BertProcessing"}, {"cls", {"<bos>", 300}}, {"sep", {"<eos>", 301}}};
  EXPECT_EQ(load(j).encode("the", true), (Ids{300, 't', 256, 301}));
}

TEST(Tokenizer, NoDecoderJoinsTokensWithSpaces) {
  json j = gpt2_like();
  j["decoder"] = nullptr;
  EXPECT_EQ(load(j).decode(Ids{'t', 256, 258}, false), "t he Ġthe");
}

TEST(Tokenizer, DecodeSkipsIdsThatNameNoToken) {
  const Tokenizer tok = load(gpt2_like());
  EXPECT_EQ(tok.decode(Ids{-1, 'h', 100000, 'i', 261}, false), "hi");
  EXPECT_FALSE(tok.id_to_token(-1).has_value());
  EXPECT_FALSE(tok.id_to_token(261).has_value());
  EXPECT_FALSE(tok.is_special(-5));
}

TEST(Tokenizer, InvalidUtf8InputReadsAsReplacementCharacters) {
  const Tokenizer tok = load(gpt2_like());
  const std::string input =
      "a\xFF"
      "b\xE4\xB8";
  EXPECT_EQ(tok.decode(tok.encode(input, false), false),
            "a\xEF\xBF\xBD"
            "b\xEF\xBF\xBD");
}

#if E4KV_HAVE_ICU
TEST(Tokenizer, NfcNormalizer) {
  json j = gpt2_like();
  j["normalizer"] = {{"type", "NFC"}};
  const Tokenizer tok = load(j);
  // e + COMBINING ACUTE ACCENT composes to é (C3 A9).
  EXPECT_EQ(tok.encode("e\u0301", false), (Ids{0xC3, 0xA9}));
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_EQ(load(j).decode(load(j).encode("ÄBC Σ", false), false), "äbc σ");
}
#else
TEST(Tokenizer, UnicodeNormalizersNeedIcu) {
  json j = gpt2_like();
  j["normalizer"] = {{"type", "NFC"}};
  const std::string message = load_error(j);
  EXPECT_NE(message.find("\"normalizer\""), std::string::npos) << message;
  EXPECT_NE(message.find("ICU"), std::string::npos) << message;
}
#endif

TEST(Tokenizer, ErrorsNameTheField) {
  struct Case {
    std::string what;
    json file;
    std::vector<std::string> needles;
  };
  std::vector<Case> cases;
  auto with = [](const std::string& pointer, const json& value) {
    json j = gpt2_like();
    j[json::json_pointer(pointer)] = value;
    return j;
  };
  cases.push_back({"model type", with("/model/type", "Unigram"), {"\"model.type\"", "Unigram"}});
  cases.push_back({"pre-tokenizer type",
                   with("/pre_tokenizer",
                        {{"type", "Sequence"},
                         {"pretokenizers", {{{"type", "ByteLevel"}}, {{"type", "Whitespace"}}}}}),
                   {"\"pre_tokenizer.pretokenizers[1].type\"", "Whitespace"}});
  cases.push_back({"normalizer type",
                   with("/normalizer", {{"type", "BertNormalizer"}}),
                   {"\"normalizer.type\"", "BertNormalizer"}});
  cases.push_back({"decoder type",
                   with("/decoder", {{"type", "WordPiece"}}),
                   {"\"decoder.type\"", "WordPiece"}});
  cases.push_back({"post-processor type",
                   with("/post_processor", {{"type", "Weird"}}),
                   {"\"post_processor.type\"", "Weird"}});
  cases.push_back({"dropout", with("/model/dropout", 0.1), {"\"model.dropout\""}});
  cases.push_back({"merge of unknown tokens",
                   with("/model/merges/0", {"h", "zz"}),
                   {"\"model.merges[0]\"", "zz"}});
  cases.push_back({"merge as a bad string",
                   with("/model/merges/0", "h e x"),
                   {"\"model.merges[0]\"", "one space"}});
  cases.push_back({"vocab id", with("/model/vocab/a", "x"), {"model.vocab", "integer"}});
  cases.push_back({"missing vocab", with("/model/vocab", nullptr), {"\"model.vocab\""}});
  cases.push_back(
      {"unk not in vocab", with("/model/unk_token", "<unk>"), {"\"model.unk_token\"", "<unk>"}});
  cases.push_back({"bad regex",
                   with("/pre_tokenizer", {{"type", "Split"},
                                           {"pattern", {{"Regex", "(unclosed"}}},
                                           {"behavior", "Isolated"},
                                           {"invert", false}}),
                   {"\"pre_tokenizer.pattern.Regex\"", "regex"}});
  cases.push_back({"split behavior",
                   with("/pre_tokenizer", {{"type", "Split"},
                                           {"pattern", {{"String", " "}}},
                                           {"behavior", "Sideways"},
                                           {"invert", false}}),
                   {"\"pre_tokenizer.behavior\"", "Sideways"}});
  cases.push_back({"added token id",
                   with("/added_tokens", {{{"id", -3}, {"content", "x"}}}),
                   {"\"added_tokens[0].id\""}});
  cases.push_back(
      {"template names an unknown token",
       with("/post_processor", {{"type", "TemplateProcessing"},
                                {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}}},
                                {"special_tokens", json::object()}}),
       {"\"post_processor.single[0]\"", "<s>"}});
  cases.push_back({"strip content",
                   with("/decoder", {{"type", "Strip"}, {"content", "ab"}}),
                   {"\"decoder.content\"", "one character"}});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string message = load_error(c.file);
    EXPECT_EQ(message.rfind("test/tokenizer.json: ", 0), 0u) << message;
    for (const std::string& needle : c.needles) {
      EXPECT_NE(message.find(needle), std::string::npos) << message;
    }
  }
  Result<Tokenizer> bad = Tokenizer::from_json("{\"model\": [1, 2,", "broken.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("broken.json: invalid JSON"), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("line 1"), std::string::npos) << bad.message();
}

TEST(Tokenizer, FromModelDirReadsTokenizerConfig) {
  TempDir tmp;
  json j = sentencepiece_like();
  write_text(tmp.path() / "tokenizer.json", j.dump());
  {
    Result<Tokenizer> tok = Tokenizer::from_model_dir(tmp.path());
    ASSERT_TRUE(tok.ok()) << tok.message();
    EXPECT_FALSE(tok->bos_id().has_value());
    EXPECT_FALSE(tok->eos_id().has_value());
  }
  write_text(tmp.path() / "tokenizer_config.json",
             R"({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": true},
                 "add_bos_token": false, "add_eos_token": true})");
  {
    Result<Tokenizer> tok = Tokenizer::from_model_dir(tmp.path());
    ASSERT_TRUE(tok.ok()) << tok.message();
    EXPECT_EQ(tok->bos_id(), 1);
    EXPECT_EQ(tok->eos_id(), 2);
    // add_bos_token false removes the template's BOS; add_eos_token true appends EOS.
    EXPECT_EQ(tok->encode("hi", true), (Ids{263, 2}));
    EXPECT_EQ(tok->encode("hi", false), (Ids{263}));
  }
  write_text(tmp.path() / "tokenizer_config.json", R"({"eos_token": "<|nope|>"})");
  {
    Result<Tokenizer> tok = Tokenizer::from_model_dir(tmp.path());
    ASSERT_FALSE(tok.ok());
    EXPECT_NE(tok.message().find("tokenizer_config.json: \"eos_token\""), std::string::npos)
        << tok.message();
  }
  Result<Tokenizer> missing = Tokenizer::from_model_dir(tmp.path() / "nowhere");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("nowhere"), std::string::npos) << missing.message();
  std::filesystem::remove(tmp.path() / "tokenizer.json");
  missing = Tokenizer::from_model_dir(tmp.path());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("tokenizer.json: not found"), std::string::npos)
      << missing.message();
}

// ---- Streaming ----------------------------------------------------------------------------------

// Tokenizers with different decoder chains, for the streaming property.
std::vector<std::pair<std::string, json>> decoder_variants() {
  std::vector<std::pair<std::string, json>> variants;
  json byte_level = gpt2_like();
  byte_level["added_tokens"] = {added_token(300, "<|eot|>", true), added_token(301, " é ", false)};
  variants.emplace_back("byte-level", byte_level);
  variants.emplace_back("sentencepiece", sentencepiece_like());
  variants.emplace_back("metaspace", metaspace_like("always", true));
  json no_decoder = gpt2_like();
  no_decoder["decoder"] = nullptr;
  variants.emplace_back("no decoder", no_decoder);
  // Fuse, then steps that see the fused text a piece at a time.
  json fused = sentencepiece_like();
  fused["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       {{{"type", "ByteFallback"}},
        {{"type", "Fuse"}},
        {{"type", "Replace"}, {"pattern", {{"String", "▁h"}}}, {"content", "[H]"}},
        {{"type", "Strip"}, {"content", "▁"}, {"start", 2}, {"stop", 2}},
        {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "never"}}}}};
  variants.emplace_back("fused chain", fused);
  json per_token = sentencepiece_like();
  per_token["decoder"] = {
      {"type", "Sequence"},
      {"decoders",
       {{{"type", "Strip"}, {"content", "▁"}, {"start", 1}, {"stop", 1}},
        {{"type", "Replace"}, {"pattern", {{"Regex", "h+"}}}, {"content", "H"}},
        {{"type", "ByteFallback"}},
        {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"}}}}};
  variants.emplace_back("per-token chain", per_token);
  return variants;
}

TEST(Tokenizer, StreamingEqualsDecodeOnRandomIds) {
  std::mt19937 rng(1234);
  for (const auto& [name, file] : decoder_variants()) {
    SCOPED_TRACE(name);
    const Tokenizer tok = load(file);
    std::uniform_int_distribution<int32_t> any_id(-2, static_cast<int32_t>(tok.vocab_size()) + 2);
    std::uniform_int_distribution<int> length(0, 40);
    for (int trial = 0; trial < 400; ++trial) {
      Ids ids(static_cast<size_t>(length(rng)));
      for (int32_t& id : ids) id = any_id(rng);
      for (bool skip : {false, true}) {
        StreamingDecoder stream(tok, skip);
        std::string streamed;
        for (int32_t id : ids) {
          const std::string piece = stream.push(id);
          EXPECT_TRUE(valid_utf8(piece));
          streamed += piece;
        }
        const std::string rest = stream.finish();
        EXPECT_TRUE(valid_utf8(rest));
        streamed += rest;
        const std::string whole = tok.decode(ids, skip);
        EXPECT_TRUE(valid_utf8(whole));
        ASSERT_EQ(streamed, whole) << "trial " << trial << " skip " << skip;
      }
    }
  }
}

TEST(Tokenizer, StreamingHoldsIncompleteCharacters) {
  const Tokenizer byte_level = load(gpt2_like());
  StreamingDecoder stream(byte_level, false);
  EXPECT_EQ(stream.push('a'), "a");
  EXPECT_EQ(stream.push(0xE4), "");
  EXPECT_EQ(stream.push(0xB8), "");
  EXPECT_EQ(stream.push(0xAD), "中");
  EXPECT_EQ(stream.push(0xE4), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");
  // finish() starts a new stream.
  EXPECT_EQ(stream.push('b'), "b");

  const Tokenizer sp = load(sentencepiece_like());
  StreamingDecoder sp_stream(sp, true);
  EXPECT_EQ(sp_stream.push(1), "");  // <s> skipped
  EXPECT_EQ(sp_stream.push(263), "hi");
  EXPECT_EQ(sp_stream.push(3 + 0xE4), "");
  EXPECT_EQ(sp_stream.push(3 + 0xB8), "");
  EXPECT_EQ(sp_stream.push(3 + 0xAD), "");  // a run of byte tokens waits for its end
  EXPECT_EQ(sp_stream.push(259), "中 ");
  EXPECT_EQ(sp_stream.finish(), "");
}

// ---- Robustness ---------------------------------------------------------------------------------

TEST(Tokenizer, RandomTextRoundTripsAndDecodesToValidUtf8) {
  const std::vector<std::string> fragments = {"a",       "Z",
                                              " ",       "  ",
                                              "\n",      "\r\n",
                                              "\t",      "'s",
                                              "'LL",     "7",
                                              "123",     ".",
                                              "!?",      "é",
                                              "ß",       "中",
                                              "語",      "한",
                                              "ع",       "ह\u094D",
                                              "e\u0301", "👩🏽\u200D💻",
                                              "🇩🇪",      "\u00A0",
                                              "\u3000",  "▁"};
  const std::vector<std::string> invalid = {"\xFF",     "\x80",     "\xE4\xB8",
                                            "\xF0\x9F", "\xC0\xAF", "\xED\xA0\x80"};
  json synth_json = json::parse(*make_synth_tokenizer_json(600));
  std::vector<std::pair<std::string, json>> files = {{"byte-level", gpt2_like()},
                                                     {"synth", synth_json},
                                                     {"sentencepiece", sentencepiece_like()},
                                                     {"metaspace", metaspace_like("first", true)}};
  std::mt19937 rng(99);
  for (const auto& [name, file] : files) {
    SCOPED_TRACE(name);
    const Tokenizer tok = load(file);
    const bool lossless = name != "metaspace";  // its vocabulary cannot spell most characters
    for (int trial = 0; trial < 300; ++trial) {
      std::string text;
      bool has_invalid = false;
      const int n = std::uniform_int_distribution<int>(0, 30)(rng);
      for (int k = 0; k < n; ++k) {
        if (trial % 2 == 1 && rng() % 8 == 0) {
          text += invalid[rng() % invalid.size()];
          has_invalid = true;
        } else {
          text += fragments[rng() % fragments.size()];
        }
      }
      const Ids ids = tok.encode(text, true);
      for (int32_t id : ids) ASSERT_TRUE(tok.id_to_token(id).has_value()) << id;
      const std::string decoded = tok.decode(ids, true);
      EXPECT_TRUE(valid_utf8(decoded));
      // A SentencePiece decoder turns every "▁" into a space, one in the text included.
      const bool spells_space = name == "sentencepiece" && text.find("▁") != std::string::npos;
      if (lossless && !has_invalid && !spells_space) {
        EXPECT_EQ(decoded, text);
      }
      if (lossless && has_invalid) {
        EXPECT_NE(decoded.find("\xEF\xBF\xBD"), std::string::npos) << decoded;
      }
    }
  }
}

TEST(Tokenizer, MutatedFilesLoadOrFailCleanly) {
  // Every value of a tokenizer.json replaced, one at a time, by values of other types: loading
  // either fails with a message or gives a tokenizer that encodes and decodes.
  const std::vector<json> replacements = {nullptr,
                                          true,
                                          -1,
                                          0,
                                          7,
                                          1e300,
                                          "",
                                          "x",
                                          "(?<",
                                          json::array(),
                                          json::object(),
                                          json::array({1, "a"}),
                                          json::object({{"type", "Sequence"}})};
  std::mt19937 rng(5);
  for (const json& base : {gpt2_like(), sentencepiece_like(), metaspace_like("first", false)}) {
    // Every leaf and every inner node (except the root).
    const json flat = base.flatten();
    std::set<std::string> pointers;
    for (const auto& [leaf, value] : flat.items()) {
      std::string pointer = leaf;  // "/a/b/c", then "/a/b", then "/a"
      while (pointer.size() > 1) {
        pointers.insert(pointer);
        const size_t slash = pointer.rfind('/');
        pointer.resize(slash == std::string::npos ? 0 : slash);
      }
    }
    for (const std::string& pointer : pointers) {
      if (pointer.find("/model/vocab/") != std::string::npos && rng() % 16 != 0) continue;
      const json& replacement = replacements[rng() % replacements.size()];
      json mutated = base;
      mutated[json::json_pointer(pointer)] = replacement;
      Result<Tokenizer> tok = Tokenizer::from_json(mutated.dump(), "mutated/tokenizer.json");
      if (!tok.ok()) {
        EXPECT_EQ(tok.message().rfind("mutated/tokenizer.json: ", 0), 0u) << tok.message();
        continue;
      }
      const Ids ids = tok->encode("Hello wörld 中 <s> 12", true);
      EXPECT_TRUE(valid_utf8(tok->decode(ids, false)));
    }
  }
}

// ---- Round trips and speed ----------------------------------------------------------------------

const std::vector<std::string>& multilingual_samples() {
  static const std::vector<std::string> samples = {
      "Hello, world! Don't stop; we've 3.14159 reasons and 1234567 more.",
      "Grüße aus München — ça va? Ελληνικά, русский язык.",
      "中文测试：你好，世界。日本語のテキスト、カタカナ。한국어 문장입니다.",
      "العربية من اليمين إلى اليسار، हिन्दी भाषा।",
      "emoji 👩🏽‍💻 👨‍👩‍👧‍👦 🇩🇪 🤷‍♀️ ❤️",
      "combining: e\u0301 a\u0308 n\u0303 Z\u0335\u0321a\u0336\u0328l\u0337g\u0322o",
      "code:\tint main() {\n    return  0;   \n}\r\n\r\n",
      "   leading and trailing spaces   ",
      "\n\n\n",
      ""};
  return samples;
}

TEST(Tokenizer, ByteLevelRoundTripsMultilingualText) {
  TempDir tmp;
  ASSERT_TRUE(write_synth_tokenizer(tmp.path(), 700).ok());
  Result<Tokenizer> synth = Tokenizer::from_model_dir(tmp.path());
  ASSERT_TRUE(synth.ok()) << synth.message();
  const Tokenizer gpt2 = load(gpt2_like());
  for (const std::string& text : multilingual_samples()) {
    EXPECT_EQ(synth->decode(synth->encode(text, true), false), text) << text;
    EXPECT_EQ(gpt2.decode(gpt2.encode(text, true), false), text) << text;
  }
}

TEST(Tokenizer, EncodesALargeTextQuickly) {
  TempDir tmp;
  ASSERT_TRUE(write_synth_tokenizer(tmp.path(), 1024).ok());
  Result<Tokenizer> synth = Tokenizer::from_model_dir(tmp.path());
  ASSERT_TRUE(synth.ok()) << synth.message();
  const Tokenizer sp = load(sentencepiece_like());
  // Mostly unique random words (the BPE cache rarely helps) between the multilingual samples.
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> letter('a', 'z');
  std::uniform_int_distribution<int> word_length(1, 12);
  std::string text;
  for (size_t i = 0; text.size() < 100 * 1024; ++i) {
    if (i % 50 == 0) text += multilingual_samples()[(i / 50) % multilingual_samples().size()];
    text += ' ';
    for (int k = word_length(rng); k > 0; --k) text += static_cast<char>(letter(rng));
  }
  for (const Tokenizer* tok : std::vector<const Tokenizer*>{&synth.value(), &sp}) {
    const auto start = std::chrono::steady_clock::now();
    const Ids ids = tok->encode(text, false);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 3.0) << "encoding " << text.size() << " bytes took " << seconds << " s";
    EXPECT_EQ(tok->decode(ids, true), text);
    std::printf("[ info ] encoded %zu bytes into %zu ids in %.3f s\n", text.size(), ids.size(),
                seconds);
  }
}

// ---- The synthetic tokenizer --------------------------------------------------------------------

TEST(Tokenizer, SynthTokenizerFitsTheVocabAndIsDeterministic) {
  for (int64_t vocab : {kSynthTokenizerMinVocab, int64_t{256}, int64_t{512}, int64_t{1024}}) {
    SCOPED_TRACE(vocab);
    Result<std::string> text = make_synth_tokenizer_json(vocab);
    ASSERT_TRUE(text.ok()) << text.message();
    Result<std::string> again = make_synth_tokenizer_json(vocab);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*text, *again);
    const Tokenizer tok = load(json::parse(*text));
    EXPECT_LE(tok.vocab_size(), vocab);
    EXPECT_TRUE(tok.is_special(*tok.token_to_id("<|endoftext|>")));
    EXPECT_TRUE(tok.token_to_id("<|im_start|>").has_value());
    EXPECT_TRUE(tok.token_to_id("<|im_end|>").has_value());
    const std::string chat = "<|im_start|>user\nThe farmer counted 12 sheep.<|im_end|>\n";
    const Ids ids = tok.encode(chat, true);
    EXPECT_EQ(ids.front(), *tok.token_to_id("<|im_start|>"));
    EXPECT_EQ(tok.decode(ids, false), chat);
    EXPECT_EQ(tok.decode(ids, true), "user\nThe farmer counted 12 sheep.\n");
  }
  // More ids mean more merges and so fewer tokens for the training text's words.
  const Tokenizer small = load(json::parse(*make_synth_tokenizer_json(300)));
  const Tokenizer large = load(json::parse(*make_synth_tokenizer_json(1024)));
  EXPECT_LT(large.encode("the farmer and the fox", false).size(),
            small.encode("the farmer and the fox", false).size());

  Result<std::string> too_small = make_synth_tokenizer_json(100);
  ASSERT_FALSE(too_small.ok());
  EXPECT_NE(too_small.message().find("246"), std::string::npos) << too_small.message();

  TempDir tmp;
  ASSERT_TRUE(write_synth_tokenizer(tmp.path() / "model", 512).ok());
  Result<Tokenizer> from_dir = Tokenizer::from_model_dir(tmp.path() / "model");
  ASSERT_TRUE(from_dir.ok()) << from_dir.message();
  EXPECT_EQ(from_dir->eos_id(), from_dir->token_to_id("<|endoftext|>"));
  EXPECT_FALSE(from_dir->bos_id().has_value());
}

}  // namespace
}  // namespace e4kv
