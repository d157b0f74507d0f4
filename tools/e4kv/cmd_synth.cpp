// e4kv synth-checkpoint OUT_DIR: writes a small synthetic checkpoint (tests, demos).
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

struct SynthArgs {
  std::string out_dir;
  std::string family = "llama";
  std::optional<int64_t> layers;  // absent: the family default
  int64_t shards = 1;
  std::string dtype = "bf16";
  bool with_kv_scales = false;
  uint64_t seed = 0;
  int64_t hidden_size = SynthCheckpointOptions{}.hidden_size;
  int64_t heads = SynthCheckpointOptions{}.n_heads;
  int64_t kv_heads = SynthCheckpointOptions{}.n_kv_heads;
  int64_t head_dim = SynthCheckpointOptions{}.head_dim;
  int64_t vocab_size = SynthCheckpointOptions{}.vocab_size;
  bool tie_embeddings = false;
  bool no_tokenizer = false;
  std::string rope_type = "default";
};

Result<DType> parse_weight_dtype(const std::string& name) {
  if (name == "f16") return DType::kF16;
  if (name == "bf16") return DType::kBF16;
  if (name == "f32") return DType::kF32;
  return Status::error(cat("--dtype: unknown dtype \"", name, "\"; expected f16, bf16 or f32"));
}

Status run_synth(const SynthArgs& args) {
  SynthCheckpointOptions options;
  E4KV_ASSIGN_OR_RETURN(options.family, parse_synth_family(args.family));
  E4KV_ASSIGN_OR_RETURN(options.dtype, parse_weight_dtype(args.dtype));
  options.n_layers = args.layers.value_or(options.family == SynthFamily::kQwen4Exp ? 8 : 4);
  options.n_shards = args.shards;
  options.with_kv_scales = args.with_kv_scales;
  options.seed = args.seed;
  options.tie_word_embeddings = args.tie_embeddings;
  options.hidden_size = args.hidden_size;
  options.n_heads = args.heads;
  options.n_kv_heads = args.kv_heads;
  options.head_dim = args.head_dim;
  options.vocab_size = args.vocab_size;
  options.rope_type = args.rope_type;
  options.with_tokenizer = !args.no_tokenizer;
  // The synthetic checkpoint's own limits (testing/synth_checkpoint.cpp), checked here so that the
  // message names the flag.
  const struct {
    const char* flag;
    int64_t value;
    int64_t max;
  } sizes[] = {{"--layers", options.n_layers, 1000},       {"--shards", args.shards, 99999},
               {"--hidden-size", args.hidden_size, 65536}, {"--heads", args.heads, 65536},
               {"--kv-heads", args.kv_heads, 65536},       {"--head-dim", args.head_dim, 65536},
               {"--vocab", args.vocab_size, 1 << 20}};
  for (const auto& size : sizes) {
    if (size.value <= 0 || size.value > size.max) {
      return Status::error(cat(size.flag, ": expected 1 to ", size.max, ", got ", size.value));
    }
  }
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
  Status written = write_synth_checkpoint(temp, options);
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
  std::printf("wrote %s checkpoint to %s: %lld layers, %zu tensors, %llu bytes, %zu shard%s\n",
              std::string(synth_family_name(options.family)).c_str(), dir.string().c_str(),
              static_cast<long long>(ckpt.config().n_layers), ckpt.tensor_names().size(),
              static_cast<unsigned long long>(bytes), ckpt.shards().size(),
              ckpt.shards().size() == 1 ? "" : "s");
  return ok_status();
}

}  // namespace

void add_synth_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "synth-checkpoint",
      "Write a small synthetic Hugging Face checkpoint with deterministic random weights");
  auto args = std::make_shared<SynthArgs>();
  cmd->add_option("OUT_DIR", args->out_dir, "Directory to create (must not exist or be empty)")
      ->required();
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
  cmd->add_option("--shards", args->shards,
                  "Number of safetensors files; more than 1 writes an index")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Weight dtype: f16, bf16 or f32")->capture_default_str();
  cmd->add_flag("--with-kv-scales", args->with_kv_scales,
                "Add F32 self_attn.k_scale / v_scale for every KV-cache layer");
  cmd->add_option("--seed", args->seed, "Seed of the weight generator")
      ->transform(decimal_integer<uint64_t>())
      ->capture_default_str();
  cmd->add_option("--hidden-size", args->hidden_size, "Hidden size")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--heads", args->heads, "Query heads")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--kv-heads", args->kv_heads, "Key/value heads")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--head-dim", args->head_dim, "Head dimension")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--vocab", args->vocab_size, "Vocabulary size")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_flag("--tie-embeddings", args->tie_embeddings, "Tie lm_head to the embedding");
  cmd->callback([args, &result] { result = one_line(run_synth(*args)); });
}

}  // namespace e4kv::cli
