// Corpus and prompt files of `e4kv calibrate` and `e4kv compare`: JSON lines, one document per
// line, each an object with exactly one of
//   {"text": "..."}                    text, encoded with the model's tokenizer (special tokens added)
//   {"token_ids": [1, 2, 3]}           token ids as they are
//   {"messages": [{"role": ..., ...}]} a conversation, rendered with the checkpoint's chat template
// A message has a role (system, user, assistant or tool) and string content; an assistant message
// may carry "tool_calls" (OpenAI's [{"type": "function", "function": {"name": ..., "arguments":
// string or object}, "id": ...}]) and then null or no content; "name", "tool_call_id" and
// "reasoning_content" are strings when given. Anything else is refused with the line and the
// field ("corpus.jsonl:3: messages[1].role: unknown role ...").
// Other keys are allowed and ignored (an "id" to name the document, say). Blank lines are skipped.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace e4kv {

enum class CorpusKind { kText, kTokenIds, kMessages };

struct CorpusDocument {
  int64_t line = 0;  // 1-based line of the file
  CorpusKind kind = CorpusKind::kText;
  std::string text;                 // kText
  std::vector<int32_t> token_ids;   // kTokenIds (each >= 0; the vocabulary is checked later)
  nlohmann::ordered_json messages;  // kMessages: a non-empty array of messages (checked as above)
  // The line's other keys, unchecked (an object, empty when none): `generate --prompts` reads a
  // request's own sampling fields here.
  nlohmann::ordered_json fields = nlohmann::ordered_json::object();
};

// Every error names `source` and the line: invalid JSON, not an object, none or several of the
// three keys, a value of the wrong type, a negative or non-integer id, an empty document.
Result<std::vector<CorpusDocument>> parse_corpus(std::string_view text, const std::string& source);
Result<std::vector<CorpusDocument>> read_corpus(const std::filesystem::path& path);

// `--shard I/N` ("0/1" is everything): document d of the file belongs to shard d % N.
struct CorpusShard {
  int64_t index = 0;
  int64_t count = 1;
};
Result<CorpusShard> parse_corpus_shard(std::string_view text);
std::vector<CorpusDocument> select_shard(std::vector<CorpusDocument> documents,
                                         const CorpusShard& shard);

}  // namespace e4kv
