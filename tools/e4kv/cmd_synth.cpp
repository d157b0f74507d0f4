// e4kv synth-checkpoint OUT_DIR: writes a small synthetic checkpoint (tests, demos).
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "commands.h"
#include "core/dtype.h"
#include "io/checkpoint.h"
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
  if (options.with_tokenizer && options.vocab_size < kSynthTokenizerMinVocab) {
    return Status::error(cat("--vocab ", options.vocab_size, " is below the ",
                             kSynthTokenizerMinVocab,
                             " ids the synthetic tokenizer needs; raise --vocab or pass "
                             "--no-tokenizer"));
  }

  const std::filesystem::path dir(args.out_dir);
  std::error_code ec;
  const bool existed = std::filesystem::exists(dir, ec);
  if (existed) {
    if (!std::filesystem::is_directory(dir, ec)) {
      return Status::error(cat(dir.string(), ": exists and is not a directory"));
    }
    if (!std::filesystem::is_empty(dir, ec)) {
      return Status::error(cat(dir.string(), ": directory is not empty; choose a new OUT_DIR"));
    }
  }
  Status written = write_synth_checkpoint(dir, options);
  if (!written.ok()) {
    // Leave no half-written checkpoint behind.
    if (existed) {
      for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
        std::filesystem::remove_all(entry.path(), ec);
      }
    } else {
      std::filesystem::remove_all(dir, ec);
    }
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
      "Number of layers (default: llama 4, qwen4exp 8)");
  cmd->add_option("--shards", args->shards,
                  "Number of safetensors files; more than 1 writes an index")
      ->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Weight dtype: f16, bf16 or f32")->capture_default_str();
  cmd->add_flag("--with-kv-scales", args->with_kv_scales,
                "Add F32 self_attn.k_scale / v_scale for every KV-cache layer");
  cmd->add_option("--seed", args->seed, "Seed of the weight generator")->capture_default_str();
  cmd->add_option("--hidden-size", args->hidden_size, "Hidden size")->capture_default_str();
  cmd->add_option("--heads", args->heads, "Query heads")->capture_default_str();
  cmd->add_option("--kv-heads", args->kv_heads, "Key/value heads")->capture_default_str();
  cmd->add_option("--head-dim", args->head_dim, "Head dimension")->capture_default_str();
  cmd->add_option("--vocab", args->vocab_size, "Vocabulary size")->capture_default_str();
  cmd->add_flag("--tie-embeddings", args->tie_embeddings, "Tie lm_head to the embedding");
  cmd->callback([args, &result] { result = one_line(run_synth(*args)); });
}

}  // namespace e4kv::cli
