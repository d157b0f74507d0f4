// e4kv capacity MODEL_DIR --budget-gib X: KV cache tokens and request concurrency for a memory
// budget, FP16 against E4M3 (reads config.json only; no weights needed). What is counted is written
// in kv/capacity.h.
// e4kv capacity MODEL_DIR --gpu-memory-gib C [--gpu-memory-utilization G] [--ple-dtype D]: the
// memory plan of the checkpoint on a card of C GiB: its weights on the device by kind (from the
// safetensors headers, quantized formats included; kv/weight_memory.h), the PLE tables in host
// memory, the KV pool left of G * C, and the maximum concurrency at 128K and 256K tokens for FP16
// and E4M3 K/V. Without --budget-gib the KV figures above use that pool as their budget.
#include <algorithm>
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
#include "kv/weight_memory.h"
#include "model/ple_ngram.h"
#include "numeric_flags.h"

namespace e4kv::cli {
namespace {

struct CapacityArgs {
  std::string model_dir;
  std::optional<double> budget_gib;
  std::optional<double> gpu_memory_gib;
  std::optional<double> gpu_memory_utilization;  // absent: 0.9
  std::string ple_dtype = "auto";
  std::optional<int64_t> request_tokens;  // absent: max_position_embeddings when the config has it
  int64_t block_size = 64;
  int64_t reserved_seqs = 1;
  int tensor_parallel_size = 1;
  bool json = false;
};

// The kinds tensor parallelism splits over the ranks (heads, channels, experts); embeddings,
// hyper-connections, norms and the rest are on every rank. The QSA indexer and the MoE router,
// replicated in the runtime, are counted with their kinds (a few percent of them).
bool split_kind(WeightKind kind) {
  return kind == WeightKind::kAttention || kind == WeightKind::kDeltaNet ||
         kind == WeightKind::kMoeExperts || kind == WeightKind::kSharedExpert ||
         kind == WeightKind::kMlp;
}

constexpr double kGib = 1024.0 * 1024.0 * 1024.0;

struct Side {
  KvCacheDtype dtype;
  KvCapacity capacity;
  std::optional<RequestConcurrency> concurrency;
};

// The context lengths of the plan's concurrency figures (128K and 256K tokens).
constexpr int64_t kPlanContexts[] = {131072, 262144};
constexpr double kDefaultUtilization = 0.9;

// The memory plan of a checkpoint on one card (--gpu-memory-gib).
struct MemoryPlan {
  WeightMemory weights;
  bool ple_e4m3 = false;
  int64_t ple_host_bytes = 0;  // as --ple-dtype holds the tables
  int64_t card_bytes = 0;
  double utilization = kDefaultUtilization;
  int64_t share_bytes = 0;    // floor(utilization * card_bytes)
  int64_t kv_pool_bytes = 0;  // share - device weights (of one rank)
  int tp = 1;                  // ranks; the figures above are one rank's
  int64_t rank_weight_bytes = 0;
  struct Context {
    int64_t tokens = 0;
    RequestConcurrency fp16, e4m3;
  };
  std::vector<Context> contexts;
};

std::string gib_text(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", double(bytes) / kGib);
  return buf;
}

Result<MemoryPlan> memory_plan(const CapacityArgs& args, const KvCacheLayout& layout) {
  MemoryPlan plan;
  E4KV_ASSIGN_OR_RETURN(const PleDtype ple_dtype, parse_ple_dtype(args.ple_dtype));
  plan.ple_e4m3 = ple_dtype == PleDtype::kE4m3;
  plan.utilization = args.gpu_memory_utilization.value_or(kDefaultUtilization);
  if (!(plan.utilization > 0.0 && plan.utilization <= 1.0)) {
    return Status::error(cat("--gpu-memory-utilization: expected a fraction in (0, 1] of the "
                             "card's memory, got ",
                             plan.utilization));
  }
  E4KV_ASSIGN_OR_RETURN(plan.weights, weight_memory(args.model_dir));
  plan.ple_host_bytes =
      plan.ple_e4m3 ? plan.weights.ple_e4m3_bytes() : plan.weights.ple_checkpoint_bytes;
  plan.card_bytes = static_cast<int64_t>(std::floor(*args.gpu_memory_gib * kGib));
  plan.share_bytes = static_cast<int64_t>(std::floor(plan.utilization * double(plan.card_bytes)));
  plan.tp = args.tensor_parallel_size;
  for (int k = 0; k < int(WeightKind::kCount); ++k) {
    const int64_t bytes = plan.weights.device_bytes[size_t(k)];
    plan.rank_weight_bytes += split_kind(WeightKind(k)) ? (bytes + plan.tp - 1) / plan.tp : bytes;
  }
  const int64_t weights = plan.rank_weight_bytes;
  if (weights >= plan.share_bytes) {
    return Status::error(cat("--gpu-memory-gib ", *args.gpu_memory_gib, ": the weights take ",
                             weights, " bytes (", gib_text(weights), ") of the card's ",
                             plan.share_bytes, " bytes at --gpu-memory-utilization ",
                             plan.utilization, "; nothing is left for the KV cache"));
  }
  plan.kv_pool_bytes = plan.share_bytes - weights;
  for (const int64_t tokens : kPlanContexts) {
    MemoryPlan::Context context;
    context.tokens = tokens;
    E4KV_ASSIGN_OR_RETURN(context.fp16, request_concurrency(layout, KvCacheDtype::kF16,
                                                            plan.kv_pool_bytes, tokens));
    E4KV_ASSIGN_OR_RETURN(context.e4m3, request_concurrency(layout, KvCacheDtype::kE4m3,
                                                            plan.kv_pool_bytes, tokens));
    plan.contexts.push_back(context);
  }
  return plan;
}

nlohmann::ordered_json plan_json(const MemoryPlan& plan) {
  nlohmann::ordered_json j;
  j["quantization"] = plan.weights.quantization;
  nlohmann::ordered_json kinds;
  for (int k = 0; k < int(WeightKind::kCount); ++k) {
    kinds[std::string(weight_kind_name(WeightKind(k)))] = {
        {"bytes", plan.weights.device_bytes[size_t(k)]},
        {"tensors", plan.weights.tensors[size_t(k)]}};
  }
  j["weights_device"] = std::move(kinds);
  j["weights_device_bytes"] = plan.weights.device_total();
  j["skipped_tensors"] = plan.weights.skipped_tensors;
  j["ple_dtype"] = plan.ple_e4m3 ? "fp8_e4m3" : "auto";
  j["ple_rows"] = plan.weights.ple_rows;
  j["ple_checkpoint_bytes"] = plan.weights.ple_checkpoint_bytes;
  j["ple_e4m3_bytes"] = plan.weights.ple_e4m3_bytes();
  j["ple_host_bytes"] = plan.ple_host_bytes;
  j["card_bytes"] = plan.card_bytes;
  j["gpu_memory_utilization"] = plan.utilization;
  j["share_bytes"] = plan.share_bytes;
  j["kv_pool_bytes"] = plan.kv_pool_bytes;
  j["tensor_parallel_size"] = plan.tp;
  j["weights_device_bytes_per_rank"] = plan.rank_weight_bytes;
  j["kv_pool_bytes_total"] = plan.kv_pool_bytes * plan.tp;
  nlohmann::ordered_json contexts = nlohmann::ordered_json::array();
  for (const MemoryPlan::Context& c : plan.contexts) {
    contexts.push_back({{"tokens", c.tokens},
                        {"max_concurrency_fp16", c.fp16.max_concurrency},
                        {"max_requests_fp16", c.fp16.max_requests},
                        {"max_concurrency_e4m3", c.e4m3.max_concurrency},
                        {"max_requests_e4m3", c.e4m3.max_requests}});
  }
  j["contexts"] = std::move(contexts);
  return j;
}

void print_plan(const MemoryPlan& plan) {
  std::printf("\nmemory plan (quantization: %s)\n", plan.weights.quantization.c_str());
  std::printf("%-28s %8s %16s %12s\n", "weights on the device", "tensors", "bytes", "GiB");
  for (int k = 0; k < int(WeightKind::kCount); ++k) {
    std::printf("  %-26s %8lld %16lld %12.3f\n", std::string(weight_kind_name(WeightKind(k))).c_str(),
                static_cast<long long>(plan.weights.tensors[size_t(k)]),
                static_cast<long long>(plan.weights.device_bytes[size_t(k)]),
                double(plan.weights.device_bytes[size_t(k)]) / kGib);
  }
  std::printf("  %-26s %8s %16lld %12.3f\n", "total", "",
              static_cast<long long>(plan.weights.device_total()),
              double(plan.weights.device_total()) / kGib);
  if (plan.weights.ple_rows > 0) {
    std::printf("PLE n-gram tables (host): %lld rows; auto %lld bytes (%s, memory-mapped), "
                "fp8_e4m3 %lld bytes (%s); --ple-dtype %s: %lld bytes\n",
                static_cast<long long>(plan.weights.ple_rows),
                static_cast<long long>(plan.weights.ple_checkpoint_bytes),
                gib_text(plan.weights.ple_checkpoint_bytes).c_str(),
                static_cast<long long>(plan.weights.ple_e4m3_bytes()),
                gib_text(plan.weights.ple_e4m3_bytes()).c_str(),
                plan.ple_e4m3 ? "fp8_e4m3" : "auto", static_cast<long long>(plan.ple_host_bytes));
  }
  if (plan.tp > 1) {
    std::printf("tensor parallel size %d: per rank %lld bytes of weights (%s; attention, "
                "DeltaNet, experts and MLPs split, the rest on every rank); the figures below "
                "are one rank's, the KV pool %lld bytes over all ranks\n",
                plan.tp, static_cast<long long>(plan.rank_weight_bytes),
                gib_text(plan.rank_weight_bytes).c_str(),
                static_cast<long long>(plan.kv_pool_bytes * plan.tp));
  }
  std::printf("card %s x %.3f = %lld bytes; weights %lld; KV pool %lld bytes (%s); activations "
              "and workspaces not counted\n",
              gib_text(plan.card_bytes).c_str(), plan.utilization,
              static_cast<long long>(plan.share_bytes),
              static_cast<long long>(plan.rank_weight_bytes),
              static_cast<long long>(plan.kv_pool_bytes), gib_text(plan.kv_pool_bytes).c_str());
  std::printf("%-28s %14s %14s\n", "max concurrency", "FP16", "E4M3");
  for (const MemoryPlan::Context& c : plan.contexts) {
    const std::string label = cat(c.tokens, " tokens");
    std::printf("%-28s %13.2fx %13.2fx\n", label.c_str(), c.fp16.max_concurrency,
                c.e4m3.max_concurrency);
  }
}

Status run_capacity(const CapacityArgs& args) {
  if (!args.budget_gib && !args.gpu_memory_gib) {
    return Status::error("give --budget-gib (a KV cache budget) or --gpu-memory-gib (a card's "
                         "memory, for the memory plan of the checkpoint's weights), or both");
  }
  if (args.budget_gib &&
      (!std::isfinite(*args.budget_gib) || *args.budget_gib <= 0.0 || *args.budget_gib > 1.0e6)) {
    return Status::error(cat("--budget-gib: expected a positive number of GiB (at most 1e6), got ",
                             *args.budget_gib));
  }
  if (args.gpu_memory_gib && (!std::isfinite(*args.gpu_memory_gib) ||
                              *args.gpu_memory_gib <= 0.0 || *args.gpu_memory_gib > 1.0e6)) {
    return Status::error(cat("--gpu-memory-gib: expected a positive number of GiB (at most "
                             "1e6), got ",
                             *args.gpu_memory_gib));
  }
  if (!args.gpu_memory_gib && args.gpu_memory_utilization) {
    return Status::error("--gpu-memory-utilization: a fraction of the card given by "
                         "--gpu-memory-gib; give that too");
  }
  if (!args.gpu_memory_gib && args.ple_dtype != "auto") {
    return Status::error("--ple-dtype: the PLE tables' host memory is part of the memory plan; "
                         "give --gpu-memory-gib too");
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
  if (args.tensor_parallel_size < 1 || args.tensor_parallel_size > kMaxTensorParallelSize) {
    return Status::error(cat("--tensor-parallel-size: expected 1 to ", kMaxTensorParallelSize,
                             " ranks, got ", args.tensor_parallel_size));
  }
  E4KV_ASSIGN_OR_RETURN(const ModelConfig config, load_model_config(args.model_dir));
  // Under tensor parallelism each rank's cache holds its share of the key/value heads (one when
  // there are fewer heads than ranks) and of the linear-attention states.
  ModelConfig rank_config = config;
  const int tp = args.tensor_parallel_size;
  if (tp > 1) {
    rank_config.n_kv_heads = config.n_kv_heads >= tp ? config.n_kv_heads / tp : 1;
    if (rank_config.qwen4exp) {
      rank_config.qwen4exp->linear_num_key_heads =
          std::max<int64_t>(1, config.qwen4exp->linear_num_key_heads / tp);
      rank_config.qwen4exp->linear_num_value_heads =
          std::max<int64_t>(1, config.qwen4exp->linear_num_value_heads / tp);
    }
  }
  Result<KvCacheLayout> layout_or = kv_cache_layout(rank_config, args.block_size);
  if (!layout_or.ok()) {
    return Status::error(cat(args.model_dir, "/config.json: ", layout_or.message()));
  }
  const KvCacheLayout layout = *layout_or;
  std::optional<MemoryPlan> plan;
  if (args.gpu_memory_gib) {
    E4KV_ASSIGN_OR_RETURN(plan, memory_plan(args, layout));
  }
  const int64_t budget_bytes = args.budget_gib
                                   ? static_cast<int64_t>(std::floor(*args.budget_gib * kGib))
                                   : plan->kv_pool_bytes;
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
    out["tensor_parallel_size"] = tp;
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
    out["memory_plan"] = plan ? plan_json(*plan) : nlohmann::ordered_json(nullptr);
    std::printf("%s\n", out.dump(2).c_str());
    return ok_status();
  }

  std::printf("model %s: %lld layers, %lld with a KV cache (%lld QSA)\n", args.model_dir.c_str(),
              static_cast<long long>(config.n_layers), static_cast<long long>(layout.n_kv_layers),
              static_cast<long long>(layout.n_qsa_layers));
  std::printf("budget %.3f GiB (%lld bytes%s), block size %lld, rings reserved for %lld "
              "sequence%s\n",
              double(budget_bytes) / kGib, static_cast<long long>(budget_bytes),
              args.budget_gib ? "" : ": the memory plan's KV pool",
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
  if (plan) print_plan(*plan);
  return ok_status();
}

}  // namespace

void add_capacity_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "capacity", "KV cache tokens and request concurrency for a memory budget, FP16 vs E4M3");
  auto args = std::make_shared<CapacityArgs>();
  cmd->add_option("MODEL_DIR", args->model_dir, "Model directory with config.json")->required();
  cmd->add_option_function<double>(
         "--budget-gib", [args](const double& g) { args->budget_gib = g; },
         "KV cache memory budget in GiB")
      ->transform(finite_number());
  cmd->add_option_function<double>(
         "--gpu-memory-gib", [args](const double& g) { args->gpu_memory_gib = g; },
         "A card's memory in GiB: the memory plan of the checkpoint's weights (safetensors "
         "headers, quantized formats included) and the KV pool they leave")
      ->transform(finite_number());
  cmd->add_option_function<double>(
         "--gpu-memory-utilization",
         [args](const double& g) { args->gpu_memory_utilization = g; },
         "The fraction of --gpu-memory-gib e4kv may take (default 0.9)")
      ->transform(finite_number());
  cmd->add_option("--ple-dtype", args->ple_dtype,
                  "PLE n-gram tables in the plan's host memory: auto or fp8_e4m3")
      ->capture_default_str();
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
  cmd->add_option("--tensor-parallel-size", args->tensor_parallel_size,
                  "Ranks of tensor parallelism: the figures are then one rank's (its share of "
                  "the key/value heads, states and split weights), with the totals beside them")
      ->transform(decimal_integer<int>(1, kMaxTensorParallelSize))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args, &result] { result = run_capacity(*args); });
}

}  // namespace e4kv::cli
