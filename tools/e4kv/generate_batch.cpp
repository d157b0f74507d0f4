#include "generate_batch.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <limits>
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
#include "engine/output.h"
#include "io/corpus.h"
#include "io/generation_config.h"
#include "progress.h"
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

// A line's own fields over the command's defaults, by vLLM's names. Unknown fields are refused (a
// misspelt "max_token" must not be silently ignored).
Status apply_fields(const json& fields, const std::string& where, RequestParams& params, json& id) {
  SamplingParams& sp = params.sampling;
  for (const auto& [key, value] : fields.items()) {
    auto fail = [&](const std::string& what) {
      return Status::error(cat(where, ": \"", key, "\" must be ", what, ", got ",
                               json_excerpt(value)));
    };
    auto number = [&](double& out) -> Status {
      if (!value.is_number()) return fail("a number");
      out = value.get<double>();
      return ok_status();
    };
    auto integer = [&](int64_t& out, int64_t lo, int64_t hi) -> Status {
      if (!value.is_number_integer() || value.get<int64_t>() < lo || value.get<int64_t>() > hi) {
        return fail(cat("an integer from ", lo, " to ", hi));
      }
      out = value.get<int64_t>();
      return ok_status();
    };
    auto boolean = [&](bool& out) -> Status {
      if (!value.is_boolean()) return fail("true or false");
      out = value.get<bool>();
      return ok_status();
    };
    constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
    Status st = ok_status();
    if (key == "id") {
      id = value;
    } else if (key == "n") {
      st = integer(params.n, 1, kMaxCompletions);
    } else if (key == "max_tokens") {
      st = integer(params.max_tokens, 0, kInt32Max);
    } else if (key == "min_tokens") {
      st = integer(params.min_tokens, 0, kInt32Max);
    } else if (key == "temperature") {
      st = number(sp.temperature);
    } else if (key == "top_p") {
      st = number(sp.top_p);
    } else if (key == "top_k") {
      st = integer(sp.top_k, -1, kInt32Max);
    } else if (key == "min_p") {
      st = number(sp.min_p);
    } else if (key == "repetition_penalty") {
      st = number(sp.repetition_penalty);
    } else if (key == "presence_penalty") {
      st = number(sp.presence_penalty);
    } else if (key == "frequency_penalty") {
      st = number(sp.frequency_penalty);
    } else if (key == "seed") {
      if (!value.is_number_unsigned()) return fail("an integer from 0 to 2^64 - 1");
      sp.seed = value.get<uint64_t>();
    } else if (key == "logit_bias") {
      // OpenAI's shape: {"token id": bias}.
      if (!value.is_object()) return fail("an object of \"token id\": bias");
      sp.logit_bias.clear();
      for (const auto& [token, bias] : value.items()) {
        int64_t t = -1;
        const auto [ptr, ec] = std::from_chars(token.data(), token.data() + token.size(), t);
        if (ec != std::errc() || ptr != token.data() + token.size() || t < 0 || t > kInt32Max ||
            !bias.is_number()) {
          return fail("an object of \"token id\": bias");
        }
        sp.logit_bias[int32_t(t)] = bias.get<double>();
      }
    } else if (key == "ignore_eos") {
      st = boolean(params.ignore_eos);
    } else if (key == "stop") {
      params.stop.clear();
      if (value.is_string()) {
        params.stop.push_back(value.get<std::string>());
      } else if (value.is_array()) {
        for (const json& v : value) {
          if (!v.is_string()) return fail("a string or an array of strings");
          params.stop.push_back(v.get<std::string>());
        }
      } else {
        return fail("a string or an array of strings");
      }
    } else if (key == "stop_token_ids") {
      if (!value.is_array()) return fail("an array of token ids");
      params.stop_ids.clear();
      for (const json& v : value) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kInt32Max) {
          return fail("an array of token ids");
        }
        params.stop_ids.push_back(int32_t(v.get<int64_t>()));
      }
    } else if (key == "include_stop_str_in_output") {
      st = boolean(params.include_stop_str_in_output);
    } else if (key == "skip_special_tokens") {
      st = boolean(params.skip_special_tokens);
    } else if (key == "logprobs") {
      st = integer(params.logprobs, 0, kMaxLogprobs);
    } else if (key == "prompt_logprobs") {
      st = integer(params.prompt_logprobs, 0, kMaxLogprobs);
    } else {
      return Status::error(cat(where, ": unknown field \"", key, "\" (", kBatchFieldsHelp, ")"));
    }
    E4KV_RETURN_IF_ERROR(st);
  }
  return ok_status();
}

json logprobs_json(const std::vector<TokenLogprobs>& entries, const Tokenizer* tokenizer) {
  json out = json::array();
  auto token_text = [&](int32_t token) {
    const int32_t one[1] = {token};
    return tokenizer != nullptr ? json(tokenizer->decode(one, /*skip_special_tokens=*/false))
                                : json(nullptr);
  };
  for (const TokenLogprobs& e : entries) {
    json top = json::array();
    for (const TokenLogprob& t : e.top) {
      json item;
      item["token_id"] = t.token;
      item["token"] = token_text(t.token);
      item["logprob"] = t.logprob;
      top.push_back(std::move(item));
    }
    json entry;
    entry["token_id"] = e.token;
    entry["token"] = token_text(e.token);
    entry["logprob"] = e.logprob;
    entry["rank"] = e.rank;
    entry["top_logprobs"] = std::move(top);
    out.push_back(std::move(entry));
  }
  return out;
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
    r.params.ignore_eos = args.ignore_eos;
    r.params.eos_ids = eos_ids;
    E4KV_RETURN_IF_ERROR(apply_fields(doc.fields, where, r.params, r.id));
    if (Status valid = validate_request_params(r.params, vocab); !valid.ok()) {
      return Status::error(cat(where, ": ", valid.message()));
    }
    Result<std::vector<int32_t>> ids = source.ids(doc, vocab);
    if (!ids.ok()) return Status::error(cat(where, ": ", ids.message()));
    r.prompt = std::move(ids).value();
    requests.push_back(std::move(r));
  }

  // Without a pool flag, a pool for the 64 largest sequences at once (the default sequence limit;
  // each completion of a request is a sequence): none is preempted unless a flag sizes the pool
  // smaller.
  int64_t largest = 1;
  int64_t n_sequences = 0;
  for (const BatchRequest& r : requests) {
    largest = std::max(largest, saturating_add(int64_t(r.prompt.size()), r.params.max_tokens));
    n_sequences += r.params.n;
  }
  E4KV_ASSIGN_OR_RETURN(LoadedModel loaded,
                        load_model(args.model, largest, /*all_rows=*/0,
                                   /*n_seqs=*/std::min<int64_t>(64, n_sequences)));
  EngineConfig engine_config;
  engine_config.enforce_eager = args.model.enforce_eager;
  Engine engine(*loaded.model, engine_config);
  const Tokenizer* tokenizer = nullptr;
  if (Result<const Tokenizer*> tok = source.tokenizer(); tok.ok()) tokenizer = *tok;
  std::optional<OutputProcessor> processor;
  if (tokenizer != nullptr) processor.emplace(*tokenizer);

  // Submitted at once, in file order; a line the engine refuses stops the command before any
  // runs (its message names the line).
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!processor && !requests[i].params.stop.empty()) {
      return Status::error(cat(args.prompts, ":", requests[i].line, ": \"stop\" strings need ",
                               "the model's tokenizer.json to read the output as text"));
    }
    Result<RequestId> id = engine.add_request(requests[i].prompt, requests[i].params);
    if (!id.ok()) {
      return Status::error(cat(args.prompts, ":", requests[i].line, ": ", id.message()));
    }
    if (processor) processor->add_request(*id, requests[i].params);
    index[*id] = i;
  }

  struct Completion_ {
    std::vector<int32_t> ids;
    std::string text;
    std::string finish_reason;
    json stop_reason;  // the stop string or token id that ended it (vLLM's stop_reason)
    std::vector<TokenLogprobs> logprobs;
  };
  struct Result_ {
    std::vector<Completion_> completions;  // [n]
    std::vector<TokenLogprobs> prompt_logprobs;
  };
  std::vector<Result_> results(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    results[i].completions.resize(size_t(requests[i].params.n));
  }
  const bool show = args.progress && isatty(fileno(stderr)) != 0;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  size_t done = 0;
  int64_t generated = 0;
  while (engine.has_unfinished()) {
    E4KV_ASSIGN_OR_RETURN(const std::vector<RequestUpdate> updates, engine.step());
    std::vector<RequestOutput> outputs;
    if (processor) {
      outputs = processor->process(updates, &engine);
    } else {
      for (const RequestUpdate& u : updates) outputs.push_back(output_without_text(u));
    }
    for (const RequestOutput& o : outputs) {
      const size_t i = index.at(o.id);
      Result_& req = results[i];
      Completion_& r = req.completions.at(size_t(o.index));
      r.ids.insert(r.ids.end(), o.new_tokens.begin(), o.new_tokens.end());
      r.text += o.new_text;
      r.logprobs.insert(r.logprobs.end(), o.logprobs.begin(), o.logprobs.end());
      req.prompt_logprobs.insert(req.prompt_logprobs.end(), o.prompt_logprobs.begin(),
                                 o.prompt_logprobs.end());
      generated += int64_t(o.new_tokens.size());
      if (!o.finished) continue;
      if (o.finish_reason == "error") {
        return Status::error(cat(args.prompts, ":", requests[i].line, ": ", o.error));
      }
      r.finish_reason = o.finish_reason;
      if (!o.stop_string.empty()) {
        r.stop_reason = o.stop_string;
      } else if (o.stop_token >= 0) {
        r.stop_reason = o.stop_token;
      }
      if (o.request_finished) ++done;
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
    const Result_& req = results[i];
    json line;
    if (!requests[i].id.is_null()) line["id"] = requests[i].id;
    // One completion's fields; n = 1 puts them on the line itself (the shape before n existed).
    auto put_completion = [&](const Completion_& r, json& into) {
      into["output_ids"] = r.ids;
      into["text"] = processor ? json(r.text) : json(nullptr);
      into["finish_reason"] = r.finish_reason;
      into["stop_reason"] = r.stop_reason;
      if (requests[i].params.logprobs >= 0) {
        into["logprobs"] = logprobs_json(r.logprobs, tokenizer);
      }
    };
    int64_t completion_tokens = 0;
    for (const Completion_& r : req.completions) completion_tokens += int64_t(r.ids.size());
    if (req.completions.size() == 1) {
      put_completion(req.completions[0], line);
    } else {
      json outputs = json::array();
      for (size_t k = 0; k < req.completions.size(); ++k) {
        json output;
        output["index"] = k;
        put_completion(req.completions[k], output);
        outputs.push_back(std::move(output));
      }
      line["outputs"] = std::move(outputs);
    }
    const int64_t n_prompt = int64_t(requests[i].prompt.size());
    prompt_tokens += n_prompt;
    line["usage"] = {{"prompt_tokens", n_prompt},
                     {"completion_tokens", completion_tokens},
                     {"total_tokens", n_prompt + completion_tokens}};
    if (requests[i].params.prompt_logprobs >= 0) {
      line["prompt_logprobs"] = logprobs_json(req.prompt_logprobs, tokenizer);
    }
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
