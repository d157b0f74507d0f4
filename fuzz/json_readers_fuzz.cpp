// libFuzzer target for the JSON readers that config_json_fuzz does not reach: the corpus / prompts
// lines (parse_corpus), tokenizer.json (Tokenizer::from_json, then an encode and a decode with an
// accepted tokenizer), the statistics lines that calibrate writes and summarize reads
// (parse_kv_stats), and scales.json (parse_scales_file). Every input goes to all four; each must
// either reject it with one line naming its source, or accept it with a result whose basic
// properties hold. Any broken property traps; nesting is bounded by the shared JSON entry point
// (core/json.h), so no input may overflow the stack.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "calib/kv_stats.h"
#include "calib/scales_file.h"
#include "io/corpus.h"
#include "io/tokenizer.h"

namespace {

void require(bool condition) {
  if (!condition) __builtin_trap();
}

void require_one_line(const std::string& message, const std::string& prefix) {
  require(message.starts_with(prefix));
  require(message.find('\n') == std::string::npos);
}

void check_corpus(std::string_view text) {
  const std::string source = "fuzz/corpus.jsonl";
  e4kv::Result<std::vector<e4kv::CorpusDocument>> docs = e4kv::parse_corpus(text, source);
  if (!docs.ok()) {
    require_one_line(docs.message(), source + ":");
    return;
  }
  require(!docs->empty());
  int64_t previous_line = 0;
  for (const e4kv::CorpusDocument& doc : *docs) {
    require(doc.line > previous_line);
    previous_line = doc.line;
    switch (doc.kind) {
      case e4kv::CorpusKind::kText:
        require(!doc.text.empty());
        break;
      case e4kv::CorpusKind::kTokenIds:
        require(!doc.token_ids.empty());
        for (int32_t id : doc.token_ids) require(id >= 0);
        break;
      case e4kv::CorpusKind::kMessages:
        require(doc.messages.is_array() && !doc.messages.empty());
        break;
    }
  }
}

void check_tokenizer(std::string_view text) {
  const std::string source = "fuzz/tokenizer.json";
  e4kv::Result<e4kv::Tokenizer> tokenizer = e4kv::Tokenizer::from_json(text, source);
  if (!tokenizer.ok()) {
    require_one_line(tokenizer.message(), source + ":");
    return;
  }
  const std::vector<int32_t> ids = tokenizer->encode("Hello, world! 12 <s>", true);
  for (int32_t id : ids) require(id >= 0);
  (void)tokenizer->decode(ids, false);
}

void check_kv_stats(std::string_view text) {
  const std::string source = "fuzz/kv-stats.jsonl";
  e4kv::Result<e4kv::KvStats> stats = e4kv::parse_kv_stats(text, source);
  if (!stats.ok()) {
    require_one_line(stats.message(), source + ":");
    return;
  }
  require(stats->size() == 2 * stats->header().kv_layers.size());
}

void check_scales(std::string_view text) {
  const std::string source = "fuzz/scales.json";
  e4kv::Result<e4kv::ScalesFile> scales = e4kv::parse_scales_file(text, source);
  if (!scales.ok()) {
    require_one_line(scales.message(), source + ":");
    return;
  }
  for (const auto& [key, value] : scales->scales) require(value > 0.0f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check_corpus(text);
  check_tokenizer(text);
  check_kv_stats(text);
  check_scales(text);
  return 0;
}
