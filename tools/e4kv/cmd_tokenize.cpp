// e4kv tokenize MODEL --text T [--json] [--no-special]: the token ids of a text.
// e4kv tokenize MODEL --corpus FILE [--json] [--special-tokens-in-content]: the token ids of each
// document of a calibrate / compare corpus, as those commands encode them (messages rendered with
// the checkpoint's chat template).
// e4kv detokenize MODEL --ids 1,2,3 [--json] [--skip-special]: the text of token ids.
// MODEL is a Hugging Face model directory holding tokenizer.json (and tokenizer_config.json).
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/utf8.h"
#include "io/corpus.h"
#include "io/tokenizer.h"
#include "prompt_source.h"

namespace e4kv::cli {
namespace {

using ordered_json = nlohmann::ordered_json;

struct TokenizeArgs {
  std::string model_dir;
  std::optional<std::string> text;
  std::optional<std::string> corpus;
  bool json = false;
  bool no_special = false;
  bool special_tokens_in_content = false;
};

struct DetokenizeArgs {
  std::string model_dir;
  std::string ids;
  bool json = false;
  bool skip_special = false;
};

Status write_stdout(const std::string& text) {
  if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() || std::fflush(stdout) != 0) {
    return Status::error("writing to standard output failed");
  }
  return ok_status();
}

std::string trim(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return std::string();
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

// "1,2, 3" -> ids; every entry must be a decimal integer naming a token of `tokenizer`. An empty
// list is no ids.
Result<std::vector<int32_t>> parse_ids(const std::string& list, const Tokenizer& tokenizer) {
  std::vector<int32_t> ids;
  if (trim(list).empty()) return ids;
  size_t index = 0;
  for (size_t pos = 0; pos <= list.size();) {
    size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    const std::string item = trim(list.substr(pos, comma - pos));
    pos = comma + 1;
    ++index;
    if (item.empty()) {
      return Status::error(
          cat("--ids: entry ", index, " is empty (expected ids separated by commas, e.g. 1,2,3)"));
    }
    const bool negative = item[0] == '-';
    const std::string digits = negative ? item.substr(1) : item;
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) {
      return Status::error(cat("--ids: entry ", index, " \"", item, "\" is not an integer"));
    }
    const bool fits =
        !negative && digits.size() <= 10 && std::stoll(digits) < tokenizer.vocab_size();
    const auto id = fits ? static_cast<int32_t>(std::stoll(digits)) : -1;
    if (!fits || !tokenizer.id_to_token(id)) {
      return Status::error(cat("--ids: entry ", index, " (", item,
                               ") is not a token id of this tokenizer (its ids are 0..",
                               tokenizer.vocab_size() - 1, ")"));
    }
    ids.push_back(id);
  }
  return ids;
}

std::string id_line(const std::vector<int32_t>& ids) {
  std::string line;
  for (int32_t id : ids) line += (line.empty() ? "" : " ") + std::to_string(id);
  return line;
}

// One line per document: its ids, or {"line": N, "ids": [...]} with --json.
Status run_tokenize_corpus(const TokenizeArgs& args) {
  if (args.no_special) {
    return Status::error(
        "--no-special applies to --text; a corpus's documents are encoded as "
        "calibrate and compare encode them");
  }
  E4KV_ASSIGN_OR_RETURN(const std::vector<CorpusDocument> docs, read_corpus(*args.corpus));
  PromptSource source{args.model_dir, args.special_tokens_in_content};
  E4KV_ASSIGN_OR_RETURN(const Tokenizer* tokenizer, source.tokenizer());
  std::string out;
  for (const CorpusDocument& doc : docs) {
    Result<std::vector<int32_t>> ids = source.ids(doc, tokenizer->vocab_size());
    if (!ids.ok()) return Status::error(cat(*args.corpus, ":", doc.line, ": ", ids.message()));
    out += args.json ? ordered_json{{"line", doc.line}, {"ids", *ids}}.dump() : id_line(*ids);
    out += "\n";
  }
  return write_stdout(out);
}

Status run_tokenize(const TokenizeArgs& args) {
  if (args.corpus) return run_tokenize_corpus(args);
  if (args.special_tokens_in_content) {
    return Status::error(
        "--special-tokens-in-content applies to the messages of --corpus; "
        "--text is encoded with every special token matched");
  }
  E4KV_ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::from_model_dir(args.model_dir));
  std::string text = *args.text;
  if (text == "-") {
    // Bounded: a prompt is text, and /dev/zero on standard input must not exhaust memory.
    constexpr size_t kMaxStdinBytes = size_t{64} << 20;
    text.clear();
    char buffer[65536];
    while (std::cin.read(buffer, sizeof(buffer)) || std::cin.gcount() > 0) {
      text.append(buffer, size_t(std::cin.gcount()));
      if (text.size() > kMaxStdinBytes) {
        return Status::error(cat("--text -: standard input is longer than ", kMaxStdinBytes,
                                 " bytes; tokenize a shorter text"));
      }
    }
    if (std::cin.bad()) return Status::error("--text -: reading standard input failed");
  }
  if (const std::optional<size_t> bad = first_invalid_utf8(text)) {
    return Status::error(cat("--text: invalid UTF-8 at byte ", *bad,
                             "; e4kv encodes UTF-8 text only (convert the input, e.g. with iconv)"));
  }
  const std::vector<int32_t> ids = tokenizer.encode(text, !args.no_special);
  if (args.json) {
    return write_stdout(ordered_json{{"ids", ids}}.dump() + "\n");
  }
  return write_stdout(id_line(ids) + "\n");
}

Status run_detokenize(const DetokenizeArgs& args) {
  E4KV_ASSIGN_OR_RETURN(Tokenizer tokenizer, Tokenizer::from_model_dir(args.model_dir));
  E4KV_ASSIGN_OR_RETURN(std::vector<int32_t> ids, parse_ids(args.ids, tokenizer));
  const std::string text = tokenizer.decode(ids, args.skip_special);
  if (args.json) {
    return write_stdout(ordered_json{{"text", text}}.dump() + "\n");
  }
  return write_stdout(text + "\n");
}

}  // namespace

void add_tokenize_commands(CLI::App& app, Status& result) {
  CLI::App* tokenize = app.add_subcommand(
      "tokenize", "Print the token ids of a text (the model directory's tokenizer.json)");
  auto t = std::make_shared<TokenizeArgs>();
  tokenize->add_option("MODEL", t->model_dir, "Model directory holding tokenizer.json")->required();
  // Exactly one input: none or both is a usage error, as a missing required flag is.
  CLI::Option_group* input = tokenize->add_option_group("input", "What to encode (one of them)");
  input->require_option(1);
  input->add_option("--text", t->text, "Text to encode; '-' reads standard input");
  input->add_option("--corpus", t->corpus,
                    "JSON lines as calibrate --corpus takes them ({\"text\": ...}, "
                    "{\"token_ids\": [...]} or {\"messages\": [...]}): one line of ids per "
                    "document, as calibrate and compare encode it");
  tokenize->add_flag("--special-tokens-in-content", t->special_tokens_in_content,
                     kSpecialTokensInContentHelp);
  tokenize->add_flag("--json", t->json, "Print {\"ids\": [...]}");
  tokenize->add_flag("--no-special", t->no_special,
                     "Do not add the post-processor's special tokens (BOS, ...)");
  tokenize->callback([t, &result] { result = one_line(run_tokenize(*t)); });

  CLI::App* detokenize = app.add_subcommand(
      "detokenize", "Print the text of token ids (the model directory's tokenizer.json)");
  auto d = std::make_shared<DetokenizeArgs>();
  detokenize->add_option("MODEL", d->model_dir, "Model directory holding tokenizer.json")
      ->required();
  detokenize->add_option("--ids", d->ids, "Token ids separated by commas, e.g. 1,2,3")->required();
  detokenize->add_flag("--json", d->json, "Print {\"text\": \"...\"}");
  detokenize->add_flag("--skip-special", d->skip_special, "Leave special tokens out of the text");
  detokenize->callback([d, &result] { result = one_line(run_detokenize(*d)); });
}

}  // namespace e4kv::cli
