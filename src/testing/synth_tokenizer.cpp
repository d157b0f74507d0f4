// The synthetic tokenizer: merges learned by counting adjacent pairs over a short text. This is
// test-data generation, kept small and obvious; the runtime tokenizer is io/tokenizer.
#include "testing/synth_tokenizer.h"

#include <array>
#include <fstream>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace e4kv {
namespace {

using ordered_json = nlohmann::ordered_json;

constexpr int64_t kMaxVocab = int64_t{1} << 20;

// The text the merges are learned from.
constexpr std::string_view kTrainingText =
    "The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into "
    "the forest before the farmer could see it.\n"
    "A tokenizer turns text into numbers that a language model can read. It splits the text into "
    "words, then joins the most frequent pairs of symbols into larger pieces, again and again, "
    "until the vocabulary is full.\n"
    "In the morning the farmer walked to the river, counted 12 sheep and 7 cows, and wrote the "
    "numbers into a small notebook. He didn't know that the fox had been watching him all along; "
    "it's a patient animal, and it'll wait for the right moment.\n"
    "When the evening came, the lights of the village went on one after another. Children ran "
    "home, dinner was served, and the old clock on the tower struck eight times.\n"
    "Models read tokens, not letters: the word \"together\" may be one token while \"tokenizer\" "
    "is three. We're testing the engine with a tiny vocabulary, so most words are split into "
    "several pieces, and that is exactly what the tests want to see.\n";

// The Qwen2 pre-tokenizer regex (that of Llama-3 with single digits).
constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

constexpr std::array<std::string_view, 3> kSpecialTokens = {"<|endoftext|>", "<|im_start|>",
                                                            "<|im_end|>"};

bool is_utf8_byte(int b) {
  return b != 0xC0 && b != 0xC1 && b < 0xF5;
}

// GPT-2's byte-level characters: printable bytes stand for themselves, the others take U+0100 on.
std::array<std::string, 256> byte_level_chars() {
  std::array<std::string, 256> chars;
  int next_extra = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next_extra++;
    std::string utf8;
    if (cp < 0x80) {
      utf8 += static_cast<char>(cp);
    } else {
      utf8 += static_cast<char>(0xC0 | (cp >> 6));
      utf8 += static_cast<char>(0x80 | (cp & 0x3F));
    }
    chars[b] = utf8;
  }
  return chars;
}

bool is_letter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

// Words of the (ASCII) training text, roughly as the runtime pre-tokenizer cuts them: letters with
// an optional leading space or punctuation mark, single digits, other runs, white space.
std::map<std::string, int64_t> count_words(std::string_view text) {
  std::map<std::string, int64_t> counts;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = pos;
    const char c = text[pos];
    if (c >= '0' && c <= '9') {
      end = pos + 1;
    } else if (is_letter(c) || (pos + 1 < text.size() && c != '\n' && is_letter(text[pos + 1]))) {
      end = pos + 1;
      while (end < text.size() && is_letter(text[end])) ++end;
    } else if (c == ' ' || c == '\n') {
      end = pos + 1;
      while (end < text.size() && (text[end] == ' ' || text[end] == '\n')) ++end;
    } else {
      end = pos + 1;
      while (end < text.size() && !is_letter(text[end]) && text[end] != ' ' && text[end] != '\n' &&
             !(text[end] >= '0' && text[end] <= '9')) {
        ++end;
      }
    }
    ++counts[std::string(text.substr(pos, end - pos))];
    pos = end;
  }
  return counts;
}

}  // namespace

Result<std::string> make_synth_tokenizer_json(int64_t vocab_size) {
  if (vocab_size < kSynthTokenizerMinVocab || vocab_size > kMaxVocab) {
    return Status::error(cat("synthetic tokenizer: vocab_size ", vocab_size, " is outside [",
                             kSynthTokenizerMinVocab, ", ", kMaxVocab,
                             "] (243 byte tokens and 3 special tokens need ",
                             kSynthTokenizerMinVocab, " ids)"));
  }
  const std::array<std::string, 256> chars = byte_level_chars();
  std::vector<std::string> vocab;  // index = id
  for (int b = 0; b < 256; ++b) {
    if (is_utf8_byte(b)) vocab.push_back(chars[b]);
  }

  // Each word as its list of symbols, with its count.
  std::vector<std::pair<std::vector<std::string>, int64_t>> words;
  for (const auto& [word, count] : count_words(kTrainingText)) {
    std::vector<std::string> symbols;
    for (char c : word) symbols.push_back(chars[static_cast<uint8_t>(c)]);
    words.emplace_back(std::move(symbols), count);
  }

  const auto max_model_ids =
      static_cast<size_t>(vocab_size - static_cast<int64_t>(kSpecialTokens.size()));
  std::vector<std::pair<std::string, std::string>> merges;
  while (vocab.size() < max_model_ids) {
    std::map<std::pair<std::string, std::string>, int64_t> pair_counts;
    for (const auto& [symbols, count] : words) {
      for (size_t i = 0; i + 1 < symbols.size(); ++i)
        pair_counts[{symbols[i], symbols[i + 1]}] += count;
    }
    const std::pair<std::string, std::string>* best = nullptr;
    int64_t best_count = 1;  // a pair must occur at least twice
    for (const auto& [pair, count] : pair_counts) {
      if (count > best_count) {
        best = &pair;
        best_count = count;
      }
    }
    if (best == nullptr) break;
    const std::pair<std::string, std::string> merge = *best;
    const std::string merged = merge.first + merge.second;
    merges.push_back(merge);
    vocab.push_back(merged);
    for (auto& [symbols, count] : words) {
      std::vector<std::string> next;
      for (size_t i = 0; i < symbols.size(); ++i) {
        if (i + 1 < symbols.size() && symbols[i] == merge.first && symbols[i + 1] == merge.second) {
          next.push_back(merged);
          ++i;
        } else {
          next.push_back(symbols[i]);
        }
      }
      symbols.swap(next);
    }
  }

  ordered_json added = ordered_json::array();
  for (size_t k = 0; k < kSpecialTokens.size(); ++k) {
    added.push_back({{"id", vocab.size() + k},
                     {"content", kSpecialTokens[k]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  ordered_json byte_level = {{"type", "ByteLevel"},
                             {"add_prefix_space", false},
                             {"trim_offsets", false},
                             {"use_regex", false}};
  ordered_json vocab_json = ordered_json::object();
  for (size_t id = 0; id < vocab.size(); ++id) vocab_json[vocab[id]] = id;
  ordered_json merges_json = ordered_json::array();
  for (const auto& [left, right] : merges) merges_json.push_back({left, right});

  ordered_json root;
  root["version"] = "1.0";
  root["truncation"] = nullptr;
  root["padding"] = nullptr;
  root["added_tokens"] = added;
  root["normalizer"] = nullptr;
  root["pre_tokenizer"] = {{"type", "Sequence"},
                           {"pretokenizers",
                            {{{"type", "Split"},
                              {"pattern", {{"Regex", kQwen2Pattern}}},
                              {"behavior", "Isolated"},
                              {"invert", false}},
                             byte_level}}};
  root["post_processor"] = byte_level;
  root["decoder"] = byte_level;
  root["model"] = {{"type", "BPE"},
                   {"dropout", nullptr},
                   {"unk_token", nullptr},
                   {"continuing_subword_prefix", nullptr},
                   {"end_of_word_suffix", nullptr},
                   {"fuse_unk", false},
                   {"byte_fallback", false},
                   {"ignore_merges", false},
                   {"vocab", vocab_json},
                   {"merges", merges_json}};
  return root.dump(2) + "\n";
}

Status write_synth_tokenizer(const std::filesystem::path& dir, int64_t vocab_size) {
  E4KV_ASSIGN_OR_RETURN(std::string tokenizer_json, make_synth_tokenizer_json(vocab_size));
  ordered_json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                         {"bos_token", nullptr},
                         {"eos_token", kSpecialTokens[0]},
                         {"pad_token", kSpecialTokens[0]},
                         {"add_bos_token", false},
                         {"model_max_length", 32768},
                         {"chat_template", kSynthChatTemplate}};
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::error(cat(dir.string(), ": cannot create directory: ", ec.message()));
  for (const auto& [name, text] :
       {std::pair<const char*, std::string>{"tokenizer.json", tokenizer_json},
        std::pair<const char*, std::string>{"tokenizer_config.json", config.dump(2) + "\n"}}) {
    const std::filesystem::path path = dir / name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) return Status::error(cat(path.string(), ": cannot open for writing"));
    out << text;
    out.close();
    if (!out) return Status::error(cat(path.string(), ": write failed"));
  }
  return ok_status();
}

}  // namespace e4kv
