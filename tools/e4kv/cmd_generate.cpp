// e4kv generate MODEL --prompt TEXT | --prompt-ids 1,2,3: one request, text streamed to stdout as
// tokens come; --json prints {"output_ids": [...], "text": ..., "finish_reason": ...} at the end.
// e4kv generate MODEL --prompts FILE.jsonl --out FILE.jsonl: every prompt of the file at once,
// continuously batched (generate_batch.h).
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/checked.h"
#include "core/utf8.h"
#include "engine/generate.h"
#include "generate_batch.h"
#include "io/generation_config.h"
#include "io/tokenizer.h"
#include "model_setup.h"
#include "numeric_flags.h"
#include "prompt_source.h"

namespace e4kv::cli {
namespace {

struct GenerateArgs {
  ModelFlags model;
  std::optional<std::string> prompt;
  std::optional<std::string> prompt_ids;
  int64_t max_tokens = 16;
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  double repetition_penalty = 1.0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  int64_t prefill_chunk = 0;
  bool json = false;
  std::optional<std::string> prompts;  // batch mode
  std::string out;
  bool force = false;
  bool special_tokens_in_content = false;
  bool progress = true;
};

Status run_batch(const GenerateArgs& args) {
  if (args.prompt || args.prompt_ids) {
    return Status::error("give --prompts FILE or one of --prompt and --prompt-ids, not both");
  }
  if (args.out.empty()) {
    return Status::error("--prompts needs --out FILE.jsonl (one output line per prompt)");
  }
  if (args.json) return Status::error("--json is for one prompt; --prompts always writes JSON lines");
  if (args.prefill_chunk != 0) {
    return Status::error("--prefill-chunk is for one prompt; with --prompts the engine's token "
                         "budget chunks prompts");
  }
  BatchGenerateArgs batch;
  batch.model = args.model;
  batch.prompts = *args.prompts;
  batch.out = args.out;
  batch.force = args.force;
  batch.special_tokens_in_content = args.special_tokens_in_content;
  batch.progress = args.progress;
  batch.max_tokens = args.max_tokens;
  batch.sampling.temperature = args.temperature;
  batch.sampling.top_p = args.top_p;
  batch.sampling.top_k = args.top_k;
  batch.sampling.repetition_penalty = args.repetition_penalty;
  batch.sampling.seed = args.seed;
  batch.ignore_eos = args.ignore_eos;
  E4KV_RETURN_IF_ERROR(validate_sampling_params(batch.sampling));
  return run_generate_batch(batch);
}

Status run_generate(const GenerateArgs& args) {
  if (args.prompts) return run_batch(args);
  if (!args.out.empty()) return Status::error("--out is for --prompts FILE (batch mode)");
  if (args.prompt.has_value() == args.prompt_ids.has_value()) {
    return Status::error(
        "give exactly one of --prompt TEXT, --prompt-ids 1,2,3 and --prompts FILE.jsonl");
  }
  E4KV_RETURN_IF_ERROR(validate_model_flags(args.model));
  if (args.max_tokens < 0 || args.max_tokens > kMaxTokenCount) {
    return Status::error(
        cat("--max-tokens: expected 0 to ", kMaxTokenCount, " tokens, got ", args.max_tokens));
  }
  if (args.prefill_chunk < 0 || args.prefill_chunk > kMaxTokenCount) {
    return Status::error(cat("--prefill-chunk: expected 0 (the whole prompt) to ", kMaxTokenCount,
                             " tokens, got ", args.prefill_chunk));
  }
  SamplingParams sampling;
  sampling.temperature = args.temperature;
  sampling.top_p = args.top_p;
  sampling.top_k = args.top_k;
  sampling.repetition_penalty = args.repetition_penalty;
  sampling.seed = args.seed;
  E4KV_RETURN_IF_ERROR(validate_sampling_params(sampling));

  // The tokenizer is optional with --prompt-ids: without one, ids are printed instead of text.
  std::optional<Tokenizer> tokenizer;
  std::error_code ec;
  const std::filesystem::path dir(args.model.model_dir);
  if (std::filesystem::exists(dir / "tokenizer.json", ec)) {
    E4KV_ASSIGN_OR_RETURN(Tokenizer loaded, Tokenizer::from_model_dir(dir));
    tokenizer.emplace(std::move(loaded));
  } else if (args.prompt) {
    if (!std::filesystem::is_directory(dir, ec)) {
      return Status::error(
          cat(args.model.model_dir, ": not a directory; MODEL is a Hugging Face model directory"));
    }
    return Status::error(cat(args.model.model_dir,
                             " has no tokenizer.json, so --prompt cannot be encoded; give "
                             "--prompt-ids instead"));
  }

  std::vector<int32_t> prompt;
  if (args.prompt) {
    if (const std::optional<size_t> bad = first_invalid_utf8(*args.prompt)) {
      return Status::error(cat("--prompt: invalid UTF-8 at byte ", *bad,
                               "; e4kv encodes UTF-8 text only (convert the input, e.g. with "
                               "iconv)"));
    }
    prompt = tokenizer->encode(*args.prompt, /*add_special_tokens=*/true);
    if (prompt.empty()) return Status::error("--prompt encodes to no tokens; give some text");
  } else {
    E4KV_ASSIGN_OR_RETURN(prompt, parse_id_list("--prompt-ids", *args.prompt_ids));
  }

  // Every input is read before the model loads (a bad generation_config.json costs nothing).
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::error(cat(args.model.model_dir,
                             ": not a directory; MODEL is a Hugging Face model directory "
                             "(config.json, *.safetensors)"));
  }
  GenerateOptions options;
  options.max_tokens = args.max_tokens;
  options.sampling = sampling;
  options.prefill_chunk = args.prefill_chunk;
  options.enforce_eager = args.model.enforce_eager;
  if (!args.ignore_eos) {
    E4KV_ASSIGN_OR_RETURN(options.stop_ids, load_eos_token_ids(dir));
    if (tokenizer && tokenizer->eos_id()) options.stop_ids.push_back(*tokenizer->eos_id());
  }
  E4KV_ASSIGN_OR_RETURN(
      LoadedModel loaded,
      load_model(args.model, saturating_add(static_cast<int64_t>(prompt.size()), args.max_tokens)));

  std::optional<StreamingDecoder> decoder;
  if (tokenizer) decoder.emplace(*tokenizer, /*skip_special_tokens=*/true);
  bool first = true;
  auto on_token = [&](int32_t id) {
    if (args.json) return;
    if (decoder) {
      const std::string piece = decoder->push(id);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
    } else {
      std::printf("%s%d", first ? "" : " ", id);
    }
    first = false;
    std::fflush(stdout);
  };
  E4KV_ASSIGN_OR_RETURN(GenerateResult result, generate(*loaded.model, prompt, options, on_token));

  if (args.json) {
    nlohmann::ordered_json out;
    out["output_ids"] = result.output_ids;
    if (tokenizer) {
      out["text"] = tokenizer->decode(result.output_ids, /*skip_special_tokens=*/true);
    } else {
      out["text"] = nullptr;
    }
    out["finish_reason"] = result.finish_reason;
    out["prompt_ids"] = prompt;
    std::printf("%s\n", out.dump().c_str());
  } else {
    if (decoder) {
      const std::string rest = decoder->finish();
      std::fwrite(rest.data(), 1, rest.size(), stdout);
    }
    std::printf("\n");
  }
  return ok_status();
}

}  // namespace

void add_generate_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "generate",
      "Generate a continuation of one prompt (text streamed to stdout as it comes), or of every "
      "prompt of a file at once (--prompts FILE --out FILE, continuous batching)");
  auto args = std::make_shared<GenerateArgs>();
  add_model_flags(cmd, args->model);
  add_pool_flags(cmd, args->model);
  cmd->add_option_function<std::string>(
      "--prompt", [args](const std::string& text) { args->prompt = text; },
      "Prompt text (encoded with the model's tokenizer, special tokens added)");
  cmd->add_option_function<std::string>(
      "--prompt-ids", [args](const std::string& text) { args->prompt_ids = text; },
      "Prompt token ids, comma-separated (1,2,3)");
  cmd->add_option("--max-tokens", args->max_tokens, "Most tokens to generate")
      ->transform(decimal_integer<int64_t>(0, kMaxTokenCount))
      ->capture_default_str();
  cmd->add_option("--temperature", args->temperature, "Sampling temperature; 0 = greedy")
      ->transform(finite_number())
      ->capture_default_str();
  cmd->add_option("--top-p", args->top_p, "Nucleus sampling mass; 1 = off")
      ->transform(finite_number())
      ->capture_default_str();
  cmd->add_option("--top-k", args->top_k, "Sample among the k most likely tokens; 0 = off")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--repetition-penalty", args->repetition_penalty,
                  "Divide positive logits (multiply negative ones) of tokens already in the "
                  "sequence by this; 1 = off")
      ->transform(finite_number())
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Seed of the sampler (runs are reproducible)")
      ->transform(decimal_integer<uint64_t>())
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", args->ignore_eos, "Do not stop at end-of-sequence tokens");
  cmd->add_option("--prefill-chunk", args->prefill_chunk,
                  "Prompt tokens per prefill forward; 0 = the whole prompt at once")
      ->transform(decimal_integer<int64_t>(0, kMaxTokenCount))
      ->capture_default_str();
  cmd->add_flag("--json", args->json,
                "Print {\"output_ids\", \"text\", \"finish_reason\", \"prompt_ids\"} at the end "
                "instead of streaming");
  cmd->add_option_function<std::string>(
      "--prompts", [args](const std::string& path) { args->prompts = path; },
      cat("Batch mode: JSON lines of {\"text\"}, {\"token_ids\"} or {\"messages\"}, each with "
          "its own sampling fields (", kBatchFieldsHelp, "; the flags are the defaults); all "
          "submitted at once and continuously batched"));
  cmd->add_option(
      "--out", args->out,
      "Batch mode: JSON lines written here, one per prompt in input order: "
      "{\"id\", \"output_ids\", \"text\", \"finish_reason\", \"stop_reason\", \"usage\", "
      "\"logprobs\", \"prompt_logprobs\"}; a line with \"n\" > 1 (completions of one "
      "prompt, prefilled once) has {\"id\", \"outputs\": [{\"index\", \"output_ids\", "
      "\"text\", \"finish_reason\", \"stop_reason\", \"logprobs\"}], \"usage\", "
      "\"prompt_logprobs\"} instead");
  cmd->add_flag("--force", args->force, "Batch mode: replace an existing --out file");
  cmd->add_flag("--special-tokens-in-content", args->special_tokens_in_content,
                kSpecialTokensInContentHelp);
  cmd->add_flag("!--no-progress", args->progress, "Batch mode: no progress line on a terminal");
  cmd->callback([args, &result] { result = run_generate(*args); });
}

}  // namespace e4kv::cli
