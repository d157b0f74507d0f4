// e4kv synth-checkpoint OUT_DIR: writes a synthetic checkpoint (tests, demos, benchmarks), with
// plain or quantized weights; --print-plan lays it out and prints its bytes without writing.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "commands.h"
#include "core/dtype.h"
#include "core/file_io.h"
#include "io/checkpoint.h"
#include "numeric_flags.h"
#include "testing/synth_checkpoint.h"
#include "testing/synth_tokenizer.h"

namespace e4kv::cli {
namespace {

// A shape flag: given, or the default of the family (or of --published).
struct ShapeFlag {
  const char* flag;
  int64_t SynthCheckpointOptions::*field;
  int64_t max;
  const char* help;
  std::optional<int64_t> value = std::nullopt;
};

struct SynthArgs {
  std::string out_dir;
  std::string family = "llama";
  std::optional<int64_t> layers;  // absent: the family default
  std::optional<int64_t> shards;
  std::optional<std::string> dtype;  // absent: bf16 (--published: f16)
  bool with_kv_scales = false;
  uint64_t seed = 0;
  bool tie_embeddings = false;
  bool no_tokenizer = false;
  std::string rope_type = "default";
  bool published = false;
  bool print_plan = false;
  std::string quant = "none";
  std::optional<int64_t> quant_group;
  bool no_zero_point = false;
  std::string quant_scope = "all-linear";
  std::optional<int64_t> ple_layer;
  std::optional<int64_t> max_shard_mb;
  std::optional<int64_t> max_total_gib;
  int64_t threads = 0;
  std::vector<ShapeFlag> shapes = {
      {"--hidden-size", &SynthCheckpointOptions::hidden_size, 65536, "Hidden size (default 64)"},
      {"--heads", &SynthCheckpointOptions::n_heads, 65536, "Query heads (default 4)"},
      {"--kv-heads", &SynthCheckpointOptions::n_kv_heads, 65536, "Key/value heads (default 2)"},
      {"--head-dim", &SynthCheckpointOptions::head_dim, 65536, "Head dimension (default 32)"},
      {"--vocab", &SynthCheckpointOptions::vocab_size, 1 << 20, "Vocabulary size (default 256)"},
      {"--intermediate-size", &SynthCheckpointOptions::intermediate_size, 65536,
       "Dense families: MLP width (default 128)"},
      {"--experts", &SynthCheckpointOptions::n_experts, 1024, "qwen4exp: routed experts (default 8)"},
      {"--expert-width", &SynthCheckpointOptions::moe_intermediate_size, 65536,
       "qwen4exp: routed expert width, moe_intermediate_size (default 32)"},
      {"--shared-expert-width", &SynthCheckpointOptions::shared_expert_intermediate_size, 65536,
       "qwen4exp: shared expert width (default 32)"},
      {"--top-k", &SynthCheckpointOptions::experts_top_k, 1024,
       "qwen4exp: experts per token (default 2; at most --experts)"},
      {"--hc-count", &SynthCheckpointOptions::hc_count, 16,
       "qwen4exp: hyper-connection streams (default 4)"},
      {"--hc-lowrank", &SynthCheckpointOptions::hc_lowrank, 65536,
       "qwen4exp: hyper-connection mixing rank (default 16)"},
      {"--linear-key-heads", &SynthCheckpointOptions::linear_key_heads, 65536,
       "qwen4exp: DeltaNet key heads (default 2)"},
      {"--linear-value-heads", &SynthCheckpointOptions::linear_value_heads, 65536,
       "qwen4exp: DeltaNet value heads (default 4)"},
      {"--linear-head-dim", &SynthCheckpointOptions::linear_head_dim, 65536,
       "qwen4exp: DeltaNet head dimension (default 16)"},
      {"--index-heads", &SynthCheckpointOptions::index_heads, 65536,
       "qwen4exp: QSA indexer heads (default 4)"},
      {"--index-dim", &SynthCheckpointOptions::index_dim, 65536,
       "qwen4exp: QSA indexer head dimension (default 32)"},
      {"--index-budget", &SynthCheckpointOptions::index_budget, 65536,
       "qwen4exp: QSA selection budget in tokens (default 64)"},
      {"--ple-ngram-base", &SynthCheckpointOptions::ple_ngram_base, int64_t(1) << 24,
       "qwen4exp: PLE ngram_vocab_size_base (default 1000)"},
  };
};

Result<DType> parse_weight_dtype(const std::string& name) {
  if (name == "f16") return DType::kF16;
  if (name == "bf16") return DType::kBF16;
  if (name == "f32") return DType::kF32;
  return Status::error(cat("--dtype: unknown dtype \"", name, "\"; expected f16, bf16 or f32"));
}

Status check_range(const char* flag, int64_t value, int64_t min, int64_t max) {
  if (value < min || value > max) {
    return Status::error(cat(flag, ": expected ", min, " to ", max, ", got ", value));
  }
  return ok_status();
}

Result<SynthCheckpointOptions> synth_options(const SynthArgs& args) {
  E4KV_ASSIGN_OR_RETURN(const SynthFamily family, parse_synth_family(args.family));
  if (args.published && family != SynthFamily::kQwen4Exp) {
    return Status::error("--published is the published Qwen4Exp shape; pass --family qwen4exp");
  }
  SynthCheckpointOptions options = args.published ? published_qwen4exp_options()
                                                  : SynthCheckpointOptions{};
  options.family = family;
  if (args.dtype) {
    E4KV_ASSIGN_OR_RETURN(options.dtype, parse_weight_dtype(*args.dtype));
  }
  if (!args.published) {
    options.n_layers = family == SynthFamily::kQwen4Exp ? 8 : 4;
  }
  // The synthetic checkpoint's own limits (testing/synth_checkpoint.cpp), checked here so that the
  // message names the flag.
  if (args.layers) {
    E4KV_RETURN_IF_ERROR(check_range("--layers", *args.layers, 1, 1000));
    options.n_layers = *args.layers;
  }
  if (args.shards) {
    E4KV_RETURN_IF_ERROR(check_range("--shards", *args.shards, 1, 99999));
    options.n_shards = *args.shards;
    options.max_shard_bytes = 0;
  }
  if (args.max_shard_mb) {
    if (args.shards) return Status::error("--shards and --max-shard-mb: pass one of them");
    E4KV_RETURN_IF_ERROR(check_range("--max-shard-mb", *args.max_shard_mb, 1, int64_t(1) << 30));
    options.max_shard_bytes = uint64_t(*args.max_shard_mb) * 1000000;
  }
  if (args.max_total_gib) {
    E4KV_RETURN_IF_ERROR(check_range("--max-total-gib", *args.max_total_gib, 1, 1 << 20));
    options.max_total_bytes = uint64_t(*args.max_total_gib) << 30;
  }
  for (const ShapeFlag& shape : args.shapes) {
    if (!shape.value) continue;
    E4KV_RETURN_IF_ERROR(check_range(shape.flag, *shape.value, 1, shape.max));
    options.*shape.field = *shape.value;
  }
  if (args.ple_layer) {
    if (family != SynthFamily::kQwen4Exp) return Status::error("--ple-layer: PLE is qwen4exp's");
    E4KV_RETURN_IF_ERROR(check_range("--ple-layer", *args.ple_layer, -1, options.n_layers - 1));
    options.ple_layer = *args.ple_layer;
  }
  options.with_kv_scales = args.with_kv_scales;
  options.seed = args.seed;
  options.tie_word_embeddings = args.tie_embeddings;
  options.rope_type = args.rope_type;
  options.with_tokenizer = !args.no_tokenizer;
  E4KV_RETURN_IF_ERROR(check_range("--threads", args.threads, 0, 4096));
  options.n_threads = int(args.threads);

  E4KV_ASSIGN_OR_RETURN(options.quant, parse_synth_quant(args.quant));
  E4KV_ASSIGN_OR_RETURN(options.quant_scope, parse_synth_quant_scope(args.quant_scope));
  if (args.quant_group && options.quant != SynthQuant::kAwq &&
      options.quant != SynthQuant::kFp8Block) {
    return Status::error("--quant-group: only --quant awq (group size) and fp8-block (block size) "
                         "take it");
  }
  if (args.no_zero_point && options.quant != SynthQuant::kAwq) {
    return Status::error("--no-zero-point: only --quant awq has zero points");
  }
  if (args.quant_group) {
    if (options.quant == SynthQuant::kAwq && *args.quant_group != 32 && *args.quant_group != 64 &&
        *args.quant_group != 128) {
      return Status::error(cat("--quant-group: AWQ groups of 32, 64 or 128 columns, got ",
                               *args.quant_group));
    }
    E4KV_RETURN_IF_ERROR(check_range("--quant-group", *args.quant_group, 1, 65536));
    options.quant_group = *args.quant_group;
  }
  options.quant_zero_point = !args.no_zero_point;
  return options;
}

Status run_synth(const SynthArgs& args) {
  E4KV_ASSIGN_OR_RETURN(const SynthCheckpointOptions options, synth_options(args));
  if (args.print_plan) {
    E4KV_ASSIGN_OR_RETURN(const SynthPlan plan, plan_synth_checkpoint(options));
    std::printf("%s checkpoint plan (nothing written)\n%s",
                std::string(synth_family_name(options.family)).c_str(),
                format_synth_plan(plan).c_str());
    return ok_status();
  }
  if (args.out_dir.empty()) {
    return Status::error("synth-checkpoint: OUT_DIR is required (or pass --print-plan)");
  }
  // Options the generator refuses are reported before any directory is made.
  E4KV_RETURN_IF_ERROR(plan_synth_checkpoint(options).status());
  if (options.with_tokenizer && options.vocab_size < kSynthTokenizerMinVocab) {
    return Status::error(cat("--vocab ", options.vocab_size, " is below the ",
                             kSynthTokenizerMinVocab,
                             " ids the synthetic tokenizer needs; raise --vocab or pass "
                             "--no-tokenizer"));
  }

  const std::filesystem::path dir(args.out_dir);
  if (Status out = check_output_dir(dir, OutputRules{}); !out.ok()) {
    return Status::error(cat("OUT_DIR ", out.message()));
  }
  // Built beside the target and renamed onto it, so a failure or a kill leaves no half-written
  // checkpoint under the final name.
  E4KV_ASSIGN_OR_RETURN(const std::filesystem::path temp, make_temporary_dir_for(dir));
  const auto start = std::chrono::steady_clock::now();
  Status written = write_synth_checkpoint(temp, options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (written.ok()) written = rename_path(temp, dir);
  if (!written.ok()) {
    std::error_code ec;
    std::filesystem::remove_all(temp, ec);
    return written;
  }
  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(dir));
  uint64_t bytes = 0;
  for (const auto& shard : ckpt.shards()) {
    for (const SafetensorsTensor& tensor : shard->tensors()) bytes += tensor.bytes.size();
  }
  std::printf("wrote %s checkpoint to %s: %lld layers, %zu tensors, %llu bytes, %zu shard%s "
              "in %.2f s (%.2f GB/s)\n",
              std::string(synth_family_name(options.family)).c_str(), dir.string().c_str(),
              static_cast<long long>(ckpt.config().n_layers), ckpt.tensor_names().size(),
              static_cast<unsigned long long>(bytes), ckpt.shards().size(),
              ckpt.shards().size() == 1 ? "" : "s", seconds, double(bytes) / 1e9 / seconds);
  return ok_status();
}

}  // namespace

void add_synth_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "synth-checkpoint",
      "Write a synthetic Hugging Face checkpoint with deterministic random (or quantized) weights");
  auto args = std::make_shared<SynthArgs>();
  cmd->add_option("OUT_DIR", args->out_dir,
                  "Directory to create (must not exist or be empty); not needed with --print-plan");
  cmd->add_option("--family", args->family,
                  "llama, mistral, qwen2 (QKV bias), qwen3 (q/k norm): dense GQA; qwen4exp: QSA + "
                  "linear attention")
      ->capture_default_str();
  cmd->add_option("--rope-type", args->rope_type,
                  "Dense families: default, linear, llama3 or yarn RoPE")
      ->capture_default_str();
  cmd->add_flag("--no-tokenizer", args->no_tokenizer,
                "Do not write the synthetic tokenizer (tokenizer.json, tokenizer_config.json)");
  cmd->add_option_function<int64_t>(
         "--layers", [args](const int64_t& n) { args->layers = n; },
         "Number of layers (default: llama 4, qwen4exp 8)")
      ->transform(decimal_integer<int64_t>());
  cmd->add_option_function<int64_t>(
         "--shards", [args](const int64_t& n) { args->shards = n; },
         "Number of safetensors files (default 1); more than 1 writes an index")
      ->transform(decimal_integer<int64_t>());
  cmd->add_option_function<int64_t>(
         "--max-shard-mb", [args](const int64_t& n) { args->max_shard_mb = n; },
         "Shards of at most this many MB (10^6 bytes) of tensors instead of --shards "
         "(--published: 4000)")
      ->transform(decimal_integer<int64_t>());
  cmd->add_option_function<int64_t>(
         "--max-total-gib", [args](const int64_t& n) { args->max_total_gib = n; },
         "Refuse to make more GiB of weights than this (default 1; --published: 64)")
      ->transform(decimal_integer<int64_t>());
  cmd->add_option_function<std::string>(
      "--dtype", [args](const std::string& d) { args->dtype = d; },
      "Weight dtype: f16, bf16 or f32 (default bf16; --published: f16)");
  cmd->add_flag("--published", args->published,
                "qwen4exp: the published model's shape (48 layers, hidden 2048, 512 experts of "
                "width 512, top-10, vocab 248320, PLE on layer 0); shape flags override it");
  cmd->add_flag("--print-plan", args->print_plan,
                "Print the tensors' bytes by kind and part of the model; write nothing");
  cmd->add_option("--quant", args->quant,
                  "Weight quantization: none, awq (AutoAWQ GEMM), nvfp4 (compressed-tensors) or "
                  "fp8-block")
      ->capture_default_str();
  cmd->add_option_function<int64_t>(
         "--quant-group", [args](const int64_t& n) { args->quant_group = n; },
         "AWQ group size (32, 64, 128; default 128) or FP8 block size (default 128)")
      ->transform(decimal_integer<int64_t>());
  cmd->add_flag("--no-zero-point", args->no_zero_point,
                "AWQ: symmetric codes (zero 8), no qzeros tensors");
  cmd->add_option("--quant-scope", args->quant_scope,
                  "all-linear (the decoder layers' projections) or experts (qwen4exp's routed "
                  "experts only)")
      ->capture_default_str();
  cmd->add_option_function<int64_t>(
         "--ple-layer", [args](const int64_t& n) { args->ple_layer = n; },
         "qwen4exp: zero-based layer with PLE, -1 for none (default none; --published: 0)")
      ->transform(decimal_integer<int64_t>());
  cmd->add_option("--threads", args->threads,
                  "Threads generating the weights (0: one per hardware thread)")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  for (ShapeFlag& shape : args->shapes) {
    cmd->add_option_function<int64_t>(
           shape.flag, [&shape](const int64_t& n) { shape.value = n; }, shape.help)
        ->transform(decimal_integer<int64_t>());
  }
  cmd->add_flag("--with-kv-scales", args->with_kv_scales,
                "Add F32 self_attn.k_scale / v_scale for every KV-cache layer");
  cmd->add_option("--seed", args->seed, "Seed of the weight generator")
      ->transform(decimal_integer<uint64_t>())
      ->capture_default_str();
  cmd->add_flag("--tie-embeddings", args->tie_embeddings, "Tie lm_head to the embedding");
  cmd->callback([args, &result] { result = one_line(run_synth(*args)); });
}

}  // namespace e4kv::cli
