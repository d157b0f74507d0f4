// e4kv synth-stats MODEL_DIR --out STATS.jsonl: synthetic calibration statistics for every KV-cache
// layer of a model, until the model runtime can observe real cache writes. Clearly labelled
// ("source": "synthetic"); they drive the demo pipeline and the CLI tests.
//
// The rows: per (layer, K|V) a magnitude factor in [e^-0.7, e^0.7], per channel a Gaussian with
// standard deviation X * factor * U(0.5, 1.5), and outlier channels (one per head plus about one in
// 16) 20 to 50 times larger; rounded to FP16 as a real cache write receives them. The shapes depend
// on --seed only, so shards of one seed are draws from one distribution; the values depend on the
// seed and the shard.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <numbers>
#include <optional>
#include <string>
#include <vector>

#include "calib/kv_stats.h"
#include "commands.h"
#include "core/checked.h"
#include "core/file_io.h"
#include "core/half.h"
#include "io/checkpoint.h"
#include "kv/scale_gate.h"
#include "numeric_flags.h"

namespace e4kv::cli {
namespace {

// The most values one run draws (see run_synth_stats).
constexpr int64_t kMaxSynthValues = int64_t{1} << 30;

struct SynthStatsArgs {
  std::string model_dir;
  std::string out;
  int64_t shard = 0;
  int64_t tokens = 2048;
  uint64_t seed = 0;
  double magnitude = 0.15;
  bool force = false;
};

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Standard normal (Box-Muller; portable, unlike std::normal_distribution).
  double gaussian() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  uint64_t state_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

uint64_t mix(uint64_t a, uint64_t b) {
  return SplitMix64(a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull)).next();
}

// Per-channel standard deviations [n_kv_heads * head_dim] of one (layer, tensor).
std::vector<float> channel_stddev(const SynthStatsArgs& args, int64_t layer, KvTensor tensor,
                                  int64_t n_kv_heads, int64_t head_dim) {
  SplitMix64 rng(mix(mix(args.seed, uint64_t(layer)), tensor == KvTensor::kK ? 1 : 2));
  const double factor = std::exp(rng.uniform(-0.7, 0.7));
  std::vector<float> stddev(size_t(n_kv_heads * head_dim));
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    const int64_t forced_outlier = int64_t(rng.next() % uint64_t(head_dim));
    for (int64_t c = 0; c < head_dim; ++c) {
      double s = args.magnitude * factor * rng.uniform(0.5, 1.5);
      if (c == forced_outlier || rng.uniform() < 1.0 / 16.0) s *= rng.uniform(20.0, 50.0);
      stddev[size_t(h * head_dim + c)] = float(s);
    }
  }
  return stddev;
}

Status run_synth_stats(const SynthStatsArgs& args) {
  if (args.shard < 0) return Status::error(cat("--shard: expected 0 or more, got ", args.shard));
  if (args.tokens <= 0) {
    return Status::error(cat("--tokens: expected 1 or more tokens, got ", args.tokens));
  }
  if (!std::isfinite(args.magnitude) || args.magnitude <= 0.0 || args.magnitude > 1000.0) {
    return Status::error(
        cat("--scale-magnitude: expected a positive number up to 1000, got ", args.magnitude));
  }
  OutputRules rules;
  rules.force = args.force;
  rules.force_name = "--force";
  rules.inputs.emplace_back(args.model_dir);
  if (Status out = check_output_file(args.out, rules); !out.ok()) {
    return Status::error(cat("--out: ", out.message()));
  }
  E4KV_ASSIGN_OR_RETURN(const Checkpoint ckpt, Checkpoint::open(args.model_dir));
  const ModelConfig& config = ckpt.config();
  const std::vector<int64_t> kv_layers = config.kv_cache_layers();
  if (kv_layers.empty()) {
    return Status::error(cat(args.model_dir, "/config.json: the model has no KV-cache layer"));
  }

  KvStatsHeader header;
  std::filesystem::path dir = std::filesystem::weakly_canonical(args.model_dir);
  header.model = dir.filename().string();
  header.prefix = kv_scale_prefix(ckpt.tensor_names());
  header.n_layers = config.n_layers;
  header.kv_layers = kv_layers;
  header.shard = args.shard;
  header.source = "synthetic";
  KvStats stats(header);

  // Values per token, and per tensor; a config whose sizes do not multiply out is refused.
  const std::optional<int64_t> row_or = checked_mul(config.n_kv_heads, config.head_dim);
  if (!row_or || *row_or > (int64_t{1} << 24)) {
    return Status::error(cat(args.model_dir, "/config.json: ", config.n_kv_heads, " KV heads x head_dim ",
                             config.head_dim, " values per token are more than synth-stats generates (",
                             int64_t{1} << 24, ")"));
  }
  const int64_t row = *row_or;
  // Every value is drawn and rounded as a cache write receives it, so the run time follows the
  // values drawn (tokens x KV tensors x values per token; about 2^30 take half a minute on one
  // core), not the token count alone: the bound is on the values.
  const int64_t values_per_token = row * int64_t(stats.size());
  const int64_t max_tokens = std::max<int64_t>(1, kMaxSynthValues / values_per_token);
  if (args.tokens > max_tokens) {
    return Status::error(cat("--tokens: expected 1 to ", max_tokens, " for this model, got ",
                             args.tokens, " (synth-stats draws at most 2^",
                             std::countr_zero(uint64_t(kMaxSynthValues)), " values: ", stats.size(),
                             " K/V tensors of ", row, " values per token)"));
  }
  constexpr int64_t kChunkTokens = 64;                      // one cache write
  std::vector<uint16_t> chunk(size_t(kChunkTokens * row));
  for (size_t i = 0; i < stats.size(); ++i) {
    const int64_t layer = stats.layer_at(i);
    const KvTensor tensor = stats.kind_at(i);
    const std::vector<float> stddev =
        channel_stddev(args, layer, tensor, config.n_kv_heads, config.head_dim);
    SplitMix64 rng(mix(mix(mix(args.seed, uint64_t(args.shard) + 1000), uint64_t(layer)),
                       tensor == KvTensor::kK ? 3 : 4));
    for (int64_t t0 = 0; t0 < args.tokens; t0 += kChunkTokens) {
      const int64_t n_tokens = std::min(kChunkTokens, args.tokens - t0);
      for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t c = 0; c < row; ++c) {
          chunk[size_t(t * row + c)] = f32_to_f16(float(rng.gaussian() * stddev[size_t(c)]));
        }
      }
      stats.at(i).observe(chunk.data(), n_tokens * row);
    }
  }
  stats.add_tokens(args.tokens);
  E4KV_RETURN_IF_ERROR(write_kv_stats(args.out, stats));
  std::printf(
      "wrote synthetic K/V statistics to %s: %zu KV-cache layers, shard %lld, %lld tokens, "
      "%lld values per tensor\n",
      args.out.c_str(), kv_layers.size(), static_cast<long long>(args.shard),
      static_cast<long long>(args.tokens), static_cast<long long>(args.tokens * row));
  return ok_status();
}

}  // namespace

void add_synth_stats_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "synth-stats",
      "Write SYNTHETIC K/V calibration statistics for a model (Gaussian rows with outlier "
      "channels, rounded to FP16), for demos and tests until the model runtime observes real "
      "cache writes");
  auto args = std::make_shared<SynthStatsArgs>();
  cmd->add_option("MODEL_DIR", args->model_dir, "Checkpoint directory (config.json + weights)")
      ->required();
  cmd->add_option("--out", args->out, "Statistics file to write (JSON lines)")->required();
  cmd->add_flag("--force", args->force, "Replace an existing statistics file");
  cmd->add_option("--shard", args->shard, "Shard number recorded in the file")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--tokens", args->tokens,
                  "Tokens per layer (at most 2^30 values drawn in all: tokens x K/V tensors x "
                  "values per token)")
      ->transform(decimal_integer<int64_t>())
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Seed of the generator")
      ->transform(decimal_integer<uint64_t>())
      ->capture_default_str();
  cmd->add_option("--scale-magnitude", args->magnitude,
                  "Standard deviation of an ordinary channel (outliers are 20-50x)")
      ->transform(finite_number())
      ->capture_default_str();
  cmd->callback([args, &result] { result = one_line(run_synth_stats(*args)); });
}

}  // namespace e4kv::cli
