// e4kv capacity MODEL_DIR --budget-gib X: KV cache tokens and request concurrency for a memory
// budget, FP16 against E4M3 (reads config.json only; no weights needed). What is counted is written
// in kv/capacity.h.
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "io/model_config.h"
#include "kv/block_allocator.h"
#include "kv/capacity.h"
#include "numeric_flags.h"

namespace e4kv::cli {
namespace {

struct CapacityArgs {
  std::string model_dir;
  double budget_gib = 0.0;
  std::optional<int64_t> request_tokens;  // absent: max_position_embeddings when the config has it
  int64_t block_size = 64;
  int64_t reserved_seqs = 1;
  bool json = false;
};

constexpr double kGib = 1024.0 * 1024.0 * 1024.0;

struct Side {
  KvCacheDtype dtype;
  KvCapacity capacity;
  std::optional<RequestConcurrency> concurrency;
};

Status run_capacity(const CapacityArgs& args) {
  if (!std::isfinite(args.budget_gib) || args.budget_gib <= 0.0 || args.budget_gib > 1.0e6) {
    return Status::error(cat("--budget-gib: expected a positive number of GiB (at most 1e6), got ",
                             args.budget_gib));
  }
  if (args.request_tokens && (*args.request_tokens <= 0 || *args.request_tokens > kMaxTokenCount)) {
    return Status::error(cat("--request-tokens: expected 1 to ", kMaxTokenCount, " tokens, got ",
                             *args.request_tokens));
  }
  if (args.reserved_seqs < 0 || args.reserved_seqs > kMaxSequences) {
    return Status::error(
        cat("--max-seqs: expected 0 to ", kMaxSequences, " sequences, got ", args.reserved_seqs));
  }
  if (Status block = validate_block_size(args.block_size); !block.ok()) {
    return Status::error(cat("--block-size: ", block.message()));
  }
  E4KV_ASSIGN_OR_RETURN(const ModelConfig config, load_model_config(args.model_dir));
  Result<KvCacheLayout> layout_or = kv_cache_layout(config, args.block_size);
  if (!layout_or.ok()) {
    return Status::error(cat(args.model_dir, "/config.json: ", layout_or.message()));
  }
  const KvCacheLayout layout = *layout_or;
  const int64_t budget_bytes = static_cast<int64_t>(std::floor(args.budget_gib * kGib));
  std::optional<int64_t> request_tokens = args.request_tokens;
  if (!request_tokens && config.max_position_embeddings > 0) {
    request_tokens = config.max_position_embeddings;
  }

  Side sides[2] = {{KvCacheDtype::kF16, {}, {}}, {KvCacheDtype::kE4m3, {}, {}}};
  for (Side& side : sides) {
    Result<KvCapacity> capacity = kv_capacity(layout, side.dtype, budget_bytes, args.reserved_seqs);
    if (!capacity.ok()) return Status::error(cat("--max-seqs ", args.reserved_seqs, ": ", capacity.message()));
    side.capacity = *capacity;
    if (request_tokens) {
      Result<RequestConcurrency> concurrency =
          request_concurrency(layout, side.dtype, budget_bytes, *request_tokens);
      if (!concurrency.ok()) {
        return Status::error(cat(args.request_tokens ? "--request-tokens " : "max_position_embeddings ",
                                 *request_tokens, ": ", concurrency.message()));
      }
      side.concurrency = *concurrency;
    }
  }
  const Side& f16 = sides[0];
  const Side& e4m3 = sides[1];
  // E4M3 tokens / FP16 tokens; 0 when not even one FP16 block fits (JSON null then).
  const double ratio = f16.capacity.n_tokens > 0
                           ? double(e4m3.capacity.n_tokens) / double(f16.capacity.n_tokens)
                           : 0.0;

  if (args.json) {
    nlohmann::ordered_json out;
    out["model_dir"] = args.model_dir;
    out["n_layers"] = config.n_layers;
    out["n_kv_layers"] = layout.n_kv_layers;
    out["n_qsa_layers"] = layout.n_qsa_layers;
    out["n_kv_heads"] = layout.n_kv_heads;
    out["head_dim"] = layout.head_dim;
    out["index_dim"] = layout.index_dim;
    out["compress_ratio"] = layout.ratio;
    out["block_size"] = layout.block_size;
    out["budget_bytes"] = budget_bytes;
    out["reserved_seqs"] = args.reserved_seqs;
    out["ring_bytes_per_seq"] = layout.ring_bytes_per_seq();
    out["state_bytes_per_seq"] = layout.state_bytes_per_seq;
    out["bytes_per_seq"] = layout.bytes_per_seq();
    out["main_bytes_per_token_per_layer_fp16"] =
        layout.main_bytes_per_token_per_layer(KvCacheDtype::kF16);
    out["main_bytes_per_token_per_layer_e4m3"] =
        layout.main_bytes_per_token_per_layer(KvCacheDtype::kE4m3);
    out["index_bytes_per_block_per_qsa_layer"] = layout.index_bytes_per_block_per_layer();
    out["index_bytes_per_token_per_qsa_layer"] =
        double(layout.index_bytes_per_block_per_layer()) / double(layout.block_size);
    for (const Side& side : sides) {
      const std::string suffix = side.dtype == KvCacheDtype::kF16 ? "_fp16" : "_e4m3";
      out["bytes_per_token" + suffix] = layout.bytes_per_token(side.dtype);
      out["block_bytes" + suffix] = layout.block_bytes(side.dtype);
      out["blocks" + suffix] = side.capacity.n_blocks;
      out["tokens" + suffix] = side.capacity.n_tokens;
    }
    out["ratio"] = ratio > 0.0 ? nlohmann::ordered_json(ratio) : nlohmann::ordered_json(nullptr);
    out["request_tokens"] =
        request_tokens ? nlohmann::ordered_json(*request_tokens) : nlohmann::ordered_json(nullptr);
    for (const Side& side : sides) {
      const std::string suffix = side.dtype == KvCacheDtype::kF16 ? "_fp16" : "_e4m3";
      if (side.concurrency) {
        out["max_concurrency" + suffix] = side.concurrency->max_concurrency;
        out["max_requests" + suffix] = side.concurrency->max_requests;
      } else {
        out["max_concurrency" + suffix] = nullptr;
        out["max_requests" + suffix] = nullptr;
      }
    }
    std::printf("%s\n", out.dump(2).c_str());
    return ok_status();
  }

  std::printf("model %s: %lld layers, %lld with a KV cache (%lld QSA)\n", args.model_dir.c_str(),
              static_cast<long long>(config.n_layers), static_cast<long long>(layout.n_kv_layers),
              static_cast<long long>(layout.n_qsa_layers));
  std::printf("budget %.3f GiB (%lld bytes), block size %lld, rings reserved for %lld sequence%s\n",
              args.budget_gib, static_cast<long long>(budget_bytes),
              static_cast<long long>(layout.block_size), static_cast<long long>(args.reserved_seqs),
              args.reserved_seqs == 1 ? "" : "s");
  std::printf("%-28s %14s %14s\n", "", "FP16", "E4M3");
  std::printf("%-28s %14lld %14lld\n", "main bytes/token/layer",
              static_cast<long long>(layout.main_bytes_per_token_per_layer(KvCacheDtype::kF16)),
              static_cast<long long>(layout.main_bytes_per_token_per_layer(KvCacheDtype::kE4m3)));
  std::printf("%-28s %14.2f %14.2f\n", "bytes/token (all layers)",
              layout.bytes_per_token(KvCacheDtype::kF16),
              layout.bytes_per_token(KvCacheDtype::kE4m3));
  std::printf("%-28s %14lld %14lld\n", "blocks", static_cast<long long>(f16.capacity.n_blocks),
              static_cast<long long>(e4m3.capacity.n_blocks));
  std::printf("%-28s %14lld %14lld\n", "tokens", static_cast<long long>(f16.capacity.n_tokens),
              static_cast<long long>(e4m3.capacity.n_tokens));
  if (layout.n_qsa_layers > 0) {
    std::printf(
        "indexer (FP16): %lld bytes/block/QSA layer compressed, %lld bytes/sequence raw ring\n",
        static_cast<long long>(layout.index_bytes_per_block_per_layer()),
        static_cast<long long>(layout.ring_bytes_per_seq()));
  }
  if (layout.state_bytes_per_seq > 0) {
    std::printf("per sequence: %lld bytes (%lld QSA raw rings, %lld recurrent and conv states)\n",
                static_cast<long long>(layout.bytes_per_seq()),
                static_cast<long long>(layout.ring_bytes_per_seq()),
                static_cast<long long>(layout.state_bytes_per_seq));
  }
  if (ratio > 0.0) std::printf("E4M3 holds %.3fx the tokens of FP16\n", ratio);
  if (request_tokens) {
    std::printf("requests of %lld tokens: max concurrency %.2fx FP16, %.2fx E4M3\n",
                static_cast<long long>(*request_tokens), f16.concurrency->max_concurrency,
                e4m3.concurrency->max_concurrency);
  }
  return ok_status();
}

}  // namespace

void add_capacity_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "capacity", "KV cache tokens and request concurrency for a memory budget, FP16 vs E4M3");
  auto args = std::make_shared<CapacityArgs>();
  cmd->add_option("MODEL_DIR", args->model_dir, "Model directory with config.json")->required();
  cmd->add_option("--budget-gib", args->budget_gib, "KV cache memory budget in GiB")
      ->transform(finite_number())
      ->required();
  cmd->add_option_function<int64_t>(
         "--request-tokens", [args](const int64_t& n) { args->request_tokens = n; },
         "Tokens per request (prompt + output) for the concurrency figure (default: "
         "max_position_embeddings)")
      ->transform(decimal_integer<int64_t>(1, kMaxTokenCount));
  cmd->add_option("--block-size", args->block_size, "Tokens per block (a multiple of 16)")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option(
         "--max-seqs", args->reserved_seqs,
         "Sequences whose QSA raw rings and recurrent states are reserved before counting blocks")
      ->transform(decimal_integer<int64_t>(0, kMaxSequences))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &result] { result = run_capacity(*args); });
}

}  // namespace e4kv::cli
