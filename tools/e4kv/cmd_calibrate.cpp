// e4kv calibrate MODEL --corpus FILE.jsonl --out STATS_DIR: the K/V statistics of DESIGN.md
// section 6 from normal FP16-KV forwards of the model over a corpus (io/corpus.h). Each document
// runs as its own sequence: the prompt in prefill chunks (--prefill-chunk, cut to
// --max-model-len), then, with --generate-tokens N, N greedy tokens so decode-time K/V are
// observed too. The model's cache writes collect the statistics where they run
// (Model::start_kv_statistics); they are read back once at the end.
//
// STATS_DIR gets kv-stats-shard-I-of-N.jsonl (calib/kv_stats.h, the input of `e4kv summarize`) and
// calibrate-shard-I-of-N.json (what ran: documents, tokens, time). --shard I/N takes every N-th
// document from the I-th, so N processes (or GPUs) split one corpus; summarize merges the shards.
// The two files of a shard are one set: the run file is written last and records the statistics
// file's size and SHA-256, and summarize reads a shard's statistics only when its run file vouches
// for them (a run killed between the two leaves a set summarize refuses). A shard's set is locked
// (STATS_DIR/.calibrate-shard-I-of-N.lock, core/output_set.h) for the run's life: a second run of
// the same shard into the same directory is refused, other shards run beside it.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "calib/kv_stats.h"
#include "commands.h"
#include "core/file_io.h"
#include "core/output_set.h"
#include "core/sha256.h"
#include "engine/generate.h"
#include "io/corpus.h"
#include "io/generation_config.h"
#include "kv/scale_gate.h"
#include "model_setup.h"
#include "numeric_flags.h"
#include "progress.h"
#include "prompt_source.h"

namespace e4kv::cli {
namespace {

namespace fs = std::filesystem;

struct CalibrateArgs {
  ModelFlags model;
  std::string corpus;
  std::string out;
  std::string shard = "0/1";
  int64_t generate_tokens = 0;
  int64_t prefill_chunk = 2048;
  int64_t max_documents = 0;
  bool force = false;
  bool progress = true;
  bool special_tokens_in_content = false;
};

// One line on a terminal, rewritten in place: documents, tokens, rate and the time left.
void show_progress(size_t done, size_t total, int64_t tokens, double seconds) {
  const double rate = seconds > 0 ? double(tokens) / seconds : 0.0;
  const double eta = done > 0 ? seconds / double(done) * double(total - done) : 0.0;
  constexpr int kWidth = 24;
  const int filled = total > 0 ? int(kWidth * done / total) : kWidth;
  std::fprintf(stderr, "\rcalibrate [%.*s%*s] %zu/%zu documents, %lld tokens, %.0f tokens/s, ETA %s ",
               filled, "########################", kWidth - filled, "", done, total,
               static_cast<long long>(tokens), rate, duration_text(eta).c_str());
  std::fflush(stderr);
}

Status run_calibrate(const CalibrateArgs& args) {
  E4KV_RETURN_IF_ERROR(validate_model_flags(args.model));
  if (args.model.kv_cache_dtype != "fp16") {
    return Status::error(cat("--kv-cache-dtype ", args.model.kv_cache_dtype,
                             ": calibrate measures the K/V values an FP16 cache stores, before any "
                             "E4M3 rounding; run it with --kv-cache-dtype fp16 (the default)"));
  }
  if (args.generate_tokens < 0 || args.generate_tokens > kMaxTokenCount) {
    return Status::error(cat("--generate-tokens: expected 0 to ", kMaxTokenCount, ", got ",
                             args.generate_tokens));
  }
  if (args.prefill_chunk < 1 || args.prefill_chunk > kMaxTokenCount) {
    return Status::error(
        cat("--prefill-chunk: expected 1 to ", kMaxTokenCount, " tokens, got ", args.prefill_chunk));
  }
  if (args.max_documents < 0) {
    return Status::error(cat("--max-documents: expected >= 0 (0: all), got ", args.max_documents));
  }
  E4KV_ASSIGN_OR_RETURN(const CorpusShard shard, parse_corpus_shard(args.shard));

  // Outputs are checked before anything runs: a long calibration must not fail at its end.
  const fs::path out_dir(args.out);
  const fs::path stats_path = out_dir / calibrate_stats_name(shard.index, shard.count);
  const fs::path run_path = out_dir / calibrate_run_name(shard.index, shard.count);
  OutputRules rules;
  rules.force = args.force;
  rules.force_name = "--force";
  rules.inputs = {fs::path(args.model.model_dir), fs::path(args.corpus)};
  auto check_outputs = [&]() -> Status {
    std::error_code ec;
    if (!fs::exists(out_dir, ec)) {
      if (Status st = check_output_dir(out_dir, rules); !st.ok()) {
        return Status::error(cat("--out: ", st.message()));
      }
      return ok_status();
    }
    if (!fs::is_directory(out_dir, ec)) {
      return Status::error(cat("--out ", args.out, ": exists and is not a directory"));
    }
    for (const fs::path& path : {stats_path, run_path}) {
      if (Status st = check_output_file(path, rules); !st.ok()) {
        return Status::error(cat("--out: ", st.message()));
      }
    }
    return ok_status();
  };
  E4KV_RETURN_IF_ERROR(check_outputs());
  // One run per shard's file set at a time (other shards may share the directory): the lock lives
  // in the directory, which is created for it and removed again if the run fails and leaves it
  // empty.
  struct CreatedDir {
    fs::path path;
    ~CreatedDir() {
      if (!path.empty()) ::rmdir(path.c_str());  // only when empty: another shard may be in it
    }
  } created_dir;
  if (::mkdir(out_dir.c_str(), 0755) == 0) {
    created_dir.path = out_dir;
  } else if (errno != EEXIST) {
    const int error = errno;
    return Status::error(cat("--out ", args.out, ": cannot create: ", errno_message(error)));
  }
  Result<OutputLock> locked = OutputLock::acquire(
      out_dir / cat(".calibrate-shard-", shard.index, "-of-", shard.count, ".lock"),
      cat(args.out, " (shard ", shard.index, "/", shard.count, ")"));
  if (!locked.ok()) return Status::error(cat("--out: ", locked.message()));
  const OutputLock lock = std::move(locked).value();
  E4KV_RETURN_IF_ERROR(check_outputs());  // again: another run may have finished meanwhile

  E4KV_ASSIGN_OR_RETURN(std::vector<CorpusDocument> all, read_corpus(args.corpus));
  const size_t corpus_documents = all.size();
  std::vector<CorpusDocument> docs = select_shard(std::move(all), shard);
  if (args.max_documents > 0 && docs.size() > size_t(args.max_documents)) {
    docs.resize(size_t(args.max_documents));
  }
  if (docs.empty()) {
    return Status::error(cat("--shard ", args.shard, ": the corpus's ", corpus_documents,
                             " documents leave none for this shard"));
  }

  // Token ids first (every document's errors before the model loads).
  E4KV_ASSIGN_OR_RETURN(Checkpoint probe, Checkpoint::open(args.model.model_dir));
  const ModelConfig config = probe.config();
  PromptSource source{fs::path(args.model.model_dir), args.special_tokens_in_content};
  std::vector<std::vector<int32_t>> prompts;
  for (const CorpusDocument& doc : docs) {
    Result<std::vector<int32_t>> ids = source.ids(doc, config.vocab_size);
    if (!ids.ok()) return Status::error(cat(args.corpus, ":", doc.line, ": ", ids.message()));
    prompts.push_back(std::move(ids).value());
  }
  const bool len_from_flag = args.model.max_model_len > 0;
  const int64_t max_len = len_from_flag ? args.model.max_model_len : config.max_position_embeddings;
  // Room for the generated tokens (N pass through the cache, the N+1-th is only sampled).
  const int64_t keep = max_len - 1 - args.generate_tokens;
  if (keep < 1) {
    // A prompt of one token and G generated tokens need G + 2 positions; say which limit is short.
    const std::string limit = len_from_flag
                                  ? cat("--max-model-len ", max_len)
                                  : cat("max_position_embeddings ", max_len, " (config.json)");
    if (args.generate_tokens == 0 || max_len < 2) {
      return Status::error(cat(limit, " leaves no room for a prompt: calibrate needs at least ",
                               args.generate_tokens + 2, " positions (a prompt token, ",
                               args.generate_tokens, " generated tokens and the last sampled "
                               "one); raise --max-model-len"));
    }
    return Status::error(cat("--generate-tokens ", args.generate_tokens,
                             " leaves no room for a prompt within ", limit,
                             " (a prompt needs 1 position, the generated tokens ",
                             args.generate_tokens + 1, "); lower --generate-tokens or raise "
                             "--max-model-len"));
  }
  int64_t truncated = 0, longest = 0;
  for (std::vector<int32_t>& p : prompts) {
    if (int64_t(p.size()) > keep) {
      p.resize(size_t(keep));
      ++truncated;
    }
    longest = std::max<int64_t>(longest, int64_t(p.size()));
  }

  E4KV_ASSIGN_OR_RETURN(LoadedModel loaded,
                        load_model(args.model, longest + args.generate_tokens + 1));
  Model& model = *loaded.model;
  E4KV_RETURN_IF_ERROR(model.start_kv_statistics());
  GenerateOptions options;
  options.max_tokens = args.generate_tokens + 1;
  options.prefill_chunk = args.prefill_chunk;
  E4KV_ASSIGN_OR_RETURN(options.stop_ids, load_eos_token_ids(args.model.model_dir));

  const bool show = args.progress && isatty(fileno(stderr)) != 0;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  int64_t prompt_tokens = 0, generated_tokens = 0;
  for (size_t d = 0; d < prompts.size(); ++d) {
    Result<GenerateResult> result = generate(model, prompts[d], options);
    if (!result.ok()) {
      if (show) std::fprintf(stderr, "\n");
      return Status::error(cat(args.corpus, ":", docs[d].line, ": ", result.message()));
    }
    prompt_tokens += int64_t(prompts[d].size());
    // Every sampled token but the last went through a forward (and the cache).
    generated_tokens += std::max<int64_t>(0, int64_t(result->output_ids.size()) - 1);
    if (show) show_progress(d + 1, prompts.size(), prompt_tokens + generated_tokens, elapsed());
  }
  E4KV_ASSIGN_OR_RETURN(std::vector<LayerKvStats> layers, model.kv_statistics());
  const double seconds = elapsed();
  if (show) std::fprintf(stderr, "\n");
  model.stop_kv_statistics();

  KvStatsHeader header;
  header.model = fs::path(args.model.model_dir).lexically_normal().filename().string();
  if (header.model.empty()) header.model = fs::absolute(args.model.model_dir).parent_path().filename();
  header.prefix = kv_scale_prefix(loaded.checkpoint->tensor_names());
  header.n_layers = config.n_layers;
  header.kv_layers = config.kv_cache_layers();
  header.shard = shard.index;
  header.source = "observed";
  KvStats stats(header);
  for (const LayerKvStats& layer : layers) {
    *stats.find(layer.layer, KvTensor::kK) = layer.k;
    *stats.find(layer.layer, KvTensor::kV) = layer.v;
  }
  const int64_t tokens = prompt_tokens + generated_tokens;
  stats.add_tokens(tokens);

  // The statistics first, the run file that vouches for them last (calib/kv_stats.h).
  const std::string stats_text = kv_stats_to_jsonl(stats);
  E4KV_RETURN_IF_ERROR(write_file_atomic(stats_path, stats_text));
  crash_point("after-statistics");
  nlohmann::ordered_json run;
  run["model"] = args.model.model_dir;
  run["corpus"] = args.corpus;
  run["shard"] = {{"index", shard.index}, {"count", shard.count}};
  run["device"] = model.backend().name();
  run["documents"] = docs.size();
  run["truncated_documents"] = truncated;
  run["max_model_len"] = max_len;
  run["prefill_chunk"] = args.prefill_chunk;
  run["generate_tokens"] = args.generate_tokens;
  run["prompt_tokens"] = prompt_tokens;
  run["generated_tokens"] = generated_tokens;
  run["tokens"] = tokens;
  run["seconds"] = seconds;
  run["tokens_per_second"] = seconds > 0 ? double(tokens) / seconds : 0.0;
  run["statistics"] = stats_path.filename().string();
  run[kRunStatisticsBytesKey] = stats_text.size();
  run[kRunStatisticsSha256Key] = sha256_hex(stats_text);
  E4KV_RETURN_IF_ERROR(write_file_atomic(run_path, run.dump(1) + "\n"));
  created_dir.path.clear();

  std::printf(
      "calibrated %zu documents of %s (shard %lld/%lld): %lld tokens (%lld prompt, %lld generated) "
      "in %.2f s, %.0f tokens/s on %s\n",
      docs.size(), args.corpus.c_str(), static_cast<long long>(shard.index),
      static_cast<long long>(shard.count), static_cast<long long>(tokens),
      static_cast<long long>(prompt_tokens), static_cast<long long>(generated_tokens), seconds,
      seconds > 0 ? double(tokens) / seconds : 0.0, model.backend().name().c_str());
  if (truncated > 0) {
    std::printf("%lld documents were cut to %lld tokens (--max-model-len %lld)\n",
                static_cast<long long>(truncated), static_cast<long long>(keep),
                static_cast<long long>(max_len));
  }
  std::printf("wrote %s and %s\n", stats_path.string().c_str(), run_path.string().c_str());
  return ok_status();
}

}  // namespace

void add_calibrate_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "calibrate",
      "K/V statistics from FP16-KV forwards of the model over a corpus (the input of summarize)");
  auto args = std::make_shared<CalibrateArgs>();
  add_model_flags(cmd, args->model);
  cmd->add_option("--corpus", args->corpus,
                  "JSON lines: {\"text\": ...}, {\"token_ids\": [...]} or {\"messages\": [...]}")
      ->required();
  cmd->add_option("--out", args->out,
                  "Directory for kv-stats-shard-I-of-N.jsonl and calibrate-shard-I-of-N.json; the "
                  "run file is written last and records the statistics' size and SHA-256, so "
                  "summarize refuses a shard whose two files do not match (re-run that shard)")
      ->required();
  cmd->add_option("--shard", args->shard,
                  "I/N: this process takes documents I, I+N, I+2N, ... (summarize merges shards)")
      ->capture_default_str();
  cmd->add_option("--generate-tokens", args->generate_tokens,
                  "Greedy tokens after each prompt, so decode-time K/V are observed too")
      ->transform(decimal_integer<int64_t>(0, kMaxTokenCount))
      ->capture_default_str();
  cmd->add_option("--prefill-chunk", args->prefill_chunk, "Prompt tokens per prefill forward")
      ->transform(decimal_integer<int64_t>(1, kMaxTokenCount))
      ->capture_default_str();
  cmd->add_option("--max-documents", args->max_documents,
                  "Stop after this many documents of the shard (0: all)")
      ->transform(decimal_integer<int64_t>(0, std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  cmd->add_flag("--special-tokens-in-content", args->special_tokens_in_content,
                kSpecialTokensInContentHelp);
  cmd->add_flag("--force", args->force, "Replace existing statistics files of this shard");
  cmd->add_flag("!--no-progress", args->progress, "No progress line on a terminal");
  cmd->callback([args, &result] { result = run_calibrate(*args); });
}

}  // namespace e4kv::cli
