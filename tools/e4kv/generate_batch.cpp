#include "generate_batch.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checked.h"
#include "core/file_io.h"
#include "core/json.h"
#include "core/output_set.h"
#include "engine/engine.h"
#include "io/corpus.h"
#include "io/generation_config.h"
#include "prompt_source.h"

namespace e4kv::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

// One line of the prompts file, ready for the engine.
struct BatchRequest {
  int64_t line = 0;
  json id;  // the line's "id", echoed in its output (null when absent)
  std::vector<int32_t> prompt;
  RequestParams params;
};

// A line's own fields over the command's defaults. Unknown fields are refused (a misspelt
// "max_token" must not be silently ignored).
Status apply_fields(const json& fields, const std::string& where, RequestParams& params,
                    bool& ignore_eos, json& id) {
  for (const auto& [key, value] : fields.items()) {
    auto number = [&]() -> Result<double> {
      if (!value.is_number()) return Status::error(cat(where, ": \"", key, "\" must be a number"));
      return value.get<double>();
    };
    auto integer = [&](int64_t lo, int64_t hi) -> Result<int64_t> {
      if (!value.is_number_integer() || value.get<int64_t>() < lo || value.get<int64_t>() > hi) {
        return Status::error(cat(where, ": \"", key, "\" must be an integer from ", lo, " to ", hi,
                                 ", got ", json_excerpt(value)));
      }
      return value.get<int64_t>();
    };
    if (key == "id") {
      id = value;
    } else if (key == "max_tokens") {
      E4KV_ASSIGN_OR_RETURN(params.max_tokens, integer(0, std::numeric_limits<int32_t>::max()));
    } else if (key == "temperature") {
      E4KV_ASSIGN_OR_RETURN(params.sampling.temperature, number());
    } else if (key == "top_p") {
      E4KV_ASSIGN_OR_RETURN(params.sampling.top_p, number());
    } else if (key == "top_k") {
      E4KV_ASSIGN_OR_RETURN(params.sampling.top_k,
                            integer(-1, std::numeric_limits<int32_t>::max()));
    } else if (key == "repetition_penalty") {
      E4KV_ASSIGN_OR_RETURN(params.sampling.repetition_penalty, number());
    } else if (key == "seed") {
      if (!value.is_number_unsigned()) {
        return Status::error(cat(where, ": \"seed\" must be an integer from 0 to 2^64 - 1"));
      }
      params.sampling.seed = value.get<uint64_t>();
    } else if (key == "ignore_eos") {
      if (!value.is_boolean()) return Status::error(cat(where, ": \"ignore_eos\" must be true or false"));
      ignore_eos = value.get<bool>();
    } else {
      return Status::error(cat(where, ": unknown field \"", key,
                               "\" (a line takes text, token_ids or messages, an id, and "
                               "max_tokens, temperature, top_p, top_k, repetition_penalty, seed, "
                               "ignore_eos)"));
    }
  }
  if (Status valid = validate_sampling_params(params.sampling); !valid.ok()) {
    return Status::error(cat(where, ": ", valid.message()));
  }
  return ok_status();
}

std::string duration_text(double seconds) {
  const int64_t s = int64_t(seconds + 0.5);
  return s >= 3600 ? cat(s / 3600, "h", (s / 60) % 60, "m") : cat(s / 60, "m", s % 60, "s");
}

}  // namespace

Status run_generate_batch(const BatchGenerateArgs& args) {
  E4KV_RETURN_IF_ERROR(validate_model_flags(args.model));
  OutputRules rules;
  rules.force = args.force;
  rules.force_name = "--force";
  rules.inputs = {fs::path(args.model.model_dir), fs::path(args.prompts)};
  if (Status st = check_output_file(args.out, rules); !st.ok()) {
    return Status::error(cat("--out: ", st.message()));
  }
  E4KV_ASSIGN_OR_RETURN(OutputLock lock, OutputLock::acquire(lock_path_for(args.out), args.out));

  // Every line's ids and parameters before the model loads: a bad line costs nothing.
  E4KV_ASSIGN_OR_RETURN(const std::vector<CorpusDocument> docs, read_corpus(args.prompts));
  E4KV_ASSIGN_OR_RETURN(Checkpoint probe, Checkpoint::open(args.model.model_dir));
  const int64_t vocab = probe.config().vocab_size;
  PromptSource source{fs::path(args.model.model_dir), args.special_tokens_in_content};
  std::vector<int32_t> eos_ids;
  {
    E4KV_ASSIGN_OR_RETURN(eos_ids, load_eos_token_ids(fs::path(args.model.model_dir)));
    std::error_code ec;
    if (fs::exists(fs::path(args.model.model_dir) / "tokenizer.json", ec)) {
      E4KV_ASSIGN_OR_RETURN(const Tokenizer* tok, source.tokenizer());
      if (tok->eos_id()) eos_ids.push_back(*tok->eos_id());
    }
  }
  std::vector<BatchRequest> requests;
  for (const CorpusDocument& doc : docs) {
    const std::string where = cat(args.prompts, ":", doc.line);
    BatchRequest r;
    r.line = doc.line;
    r.params.max_tokens = args.max_tokens;
    r.params.sampling = args.sampling;
    bool ignore_eos = args.ignore_eos;
    E4KV_RETURN_IF_ERROR(apply_fields(doc.fields, where, r.params, ignore_eos, r.id));
    if (!ignore_eos) r.params.stop_ids = eos_ids;
    Result<std::vector<int32_t>> ids = source.ids(doc, vocab);
    if (!ids.ok()) return Status::error(cat(where, ": ", ids.message()));
    r.prompt = std::move(ids).value();
    requests.push_back(std::move(r));
  }

  // A pool for the 64 largest requests at once (the default sequence limit): none is preempted
  // unless a flag sizes the pool smaller.
  std::vector<int64_t> totals;
  for (const BatchRequest& r : requests) {
    totals.push_back(saturating_add(int64_t(r.prompt.size()), r.params.max_tokens));
  }
  std::sort(totals.begin(), totals.end(), std::greater<>());
  int64_t pool_tokens = 0;
  for (size_t i = 0; i < totals.size() && i < 64; ++i) {
    pool_tokens = saturating_add(pool_tokens, totals[i]);
  }
  E4KV_ASSIGN_OR_RETURN(LoadedModel loaded,
                        load_model(args.model, pool_tokens, /*all_rows=*/0,
                                   /*max_requests=*/std::min<int64_t>(64, int64_t(totals.size()))));
  Engine engine(*loaded.model, {});
  const Tokenizer* tokenizer = nullptr;
  if (Result<const Tokenizer*> tok = source.tokenizer(); tok.ok()) tokenizer = *tok;

  // Submitted at once, in file order; a line the engine refuses stops the command before any
  // runs (its message names the line).
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) {
    Result<RequestId> id = engine.add_request(requests[i].prompt, requests[i].params);
    if (!id.ok()) {
      return Status::error(cat(args.prompts, ":", requests[i].line, ": ", id.message()));
    }
    index[*id] = i;
  }

  std::vector<std::vector<int32_t>> outputs(requests.size());
  std::vector<std::string> reasons(requests.size());
  const bool show = args.progress && isatty(fileno(stderr)) != 0;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  size_t done = 0;
  int64_t generated = 0;
  while (engine.has_unfinished()) {
    E4KV_ASSIGN_OR_RETURN(const std::vector<RequestUpdate> updates, engine.step());
    for (const RequestUpdate& u : updates) {
      const size_t i = index.at(u.id);
      outputs[i].insert(outputs[i].end(), u.new_tokens.begin(), u.new_tokens.end());
      generated += int64_t(u.new_tokens.size());
      if (!u.finished) continue;
      if (u.finish_reason == "error") {
        return Status::error(cat(args.prompts, ":", requests[i].line, ": ", u.error));
      }
      reasons[i] = u.finish_reason;
      ++done;
    }
    if (show) {
      const double s = elapsed();
      std::fprintf(stderr, "\rgenerate %zu/%zu requests, %lld tokens, %.0f tokens/s, %s ", done,
                   requests.size(), static_cast<long long>(generated),
                   s > 0 ? double(generated) / s : 0.0, duration_text(s).c_str());
      std::fflush(stderr);
    }
  }
  const double seconds = elapsed();
  if (show) std::fprintf(stderr, "\n");

  std::string text;
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    json line;
    if (!requests[i].id.is_null()) line["id"] = requests[i].id;
    line["output_ids"] = outputs[i];
    line["text"] = tokenizer != nullptr
                       ? json(tokenizer->decode(outputs[i], /*skip_special_tokens=*/true))
                       : json(nullptr);
    line["finish_reason"] = reasons[i];
    const int64_t n_prompt = int64_t(requests[i].prompt.size());
    prompt_tokens += n_prompt;
    line["usage"] = {{"prompt_tokens", n_prompt},
                     {"completion_tokens", outputs[i].size()},
                     {"total_tokens", n_prompt + int64_t(outputs[i].size())}};
    text += line.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  }
  E4KV_RETURN_IF_ERROR(write_file_atomic(args.out, text));
  std::fprintf(stderr,
               "e4kv: %zu requests, %lld prompt and %lld generated tokens in %.2f s (%.0f "
               "generated tokens/s), %lld preemptions; wrote %s\n",
               requests.size(), static_cast<long long>(prompt_tokens),
               static_cast<long long>(generated), seconds,
               seconds > 0 ? double(generated) / seconds : 0.0,
               static_cast<long long>(engine.scheduler().n_preemptions()), args.out.c_str());
  return ok_status();
}

}  // namespace e4kv::cli
