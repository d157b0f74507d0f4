// Synthetic checkpoints with quantized weights (testing/synth_checkpoint.h): they load through the
// runtime's loader and run on the CPU backend, their codes and scales dequantize to weights of the
// float initialiser's magnitude, the streaming writer writes what write_safetensors makes of the
// in-memory checkpoint, the bytes do not depend on the thread count, config.json's
// quantization_config reads back, and the plan of the published Qwen4Exp size adds up and agrees
// with the memory plan `e4kv capacity` reads from the written headers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/json.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "kv/weight_memory.h"
#include "kv/block_allocator.h"
#include "model/model.h"
#include "model/weights.h"
#include "quant/dequantize.h"
#include "quant/quant_config.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

struct QuantCase {
  const char* name;
  SynthQuant quant;
  int64_t group;
  bool zero_point;
};

const QuantCase kCases[] = {
    {"awq_g32", SynthQuant::kAwq, 32, true},
    {"awq_g64_sym", SynthQuant::kAwq, 64, false},
    {"nvfp4", SynthQuant::kNvfp4, 0, true},
    {"fp8_block32", SynthQuant::kFp8Block, 32, true},
};

SynthCheckpointOptions small_qwen4exp() {
  SynthCheckpointOptions o;
  o.family = SynthFamily::kQwen4Exp;
  o.n_layers = 4;
  o.hidden_size = 64;
  o.head_dim = 16;
  o.vocab_size = 256;
  o.ple_layer = 1;
  o.dtype = DType::kF16;
  return o;
}

SynthCheckpointOptions small_llama() {
  SynthCheckpointOptions o;
  o.family = SynthFamily::kLlama;
  o.n_layers = 2;
  o.hidden_size = 128;
  o.vocab_size = 256;
  o.dtype = DType::kF16;
  return o;
}

SynthCheckpointOptions with_quant(SynthCheckpointOptions o, const QuantCase& c,
                                  SynthQuantScope scope) {
  o.quant = c.quant;
  if (c.group > 0) o.quant_group = c.group;
  o.quant_zero_point = c.zero_point;
  o.quant_scope = scope;
  return o;
}

std::vector<float> last_logits(const fs::path& dir) {
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.message();
  if (!ckpt.ok()) return {};
  auto backend = make_cpu_backend();
  ModelOptions options;
  options.kv_cache_dtype = KvCacheDtype::kF16;
  options.block_size = 16;
  options.n_blocks = 4;
  options.max_model_len = 48;
  Result<std::unique_ptr<Model>> model = load_model(*ckpt, *backend, options);
  EXPECT_TRUE(model.ok()) << model.message();
  if (!model.ok()) return {};
  Model& m = **model;
  const std::vector<int32_t> ids = {1, 17, 42, 7, 99, 3, 250, 64, 5, 128, 33, 2};
  BlockAllocator allocator(m.n_blocks(), m.block_size());
  BlockTable table;
  allocator.append(table, int64_t(ids.size()));
  Result<ScopedSequence> seq = ScopedSequence::allocate(m);
  EXPECT_TRUE(seq.ok()) << seq.message();
  if (!seq.ok()) return {};
  std::vector<int32_t> seqs(ids.size(), 0), pos(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) pos[i] = int32_t(i);
  const int32_t last = int32_t(ids.size() - 1);
  const int32_t slot = seq->slot();
  Result<std::vector<float>> logits =
      m.forward({ids, seqs, pos, {&table}, std::span<const int32_t>(&last, 1),
                 std::span<const int32_t>(&slot, 1)});
  EXPECT_TRUE(logits.ok()) << logits.message();
  return logits.ok() ? *logits : std::vector<float>{};
}

double rms(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += double(x) * x;
  return std::sqrt(sum / double(v.size()));
}

// The modules stored quantized, by the tensors the formats add.
std::vector<std::string> quantized_modules(const Checkpoint& ckpt) {
  std::vector<std::string> modules;
  for (const std::string& name : ckpt.tensor_names()) {
    for (const char* suffix : {".qweight", ".weight_packed", ".weight_scale_inv"}) {
      if (name.ends_with(suffix)) modules.push_back(name.substr(0, name.size() - strlen(suffix)));
    }
  }
  std::sort(modules.begin(), modules.end());
  return modules;
}

std::vector<std::byte> file_bytes(const fs::path& path) {
  const std::string text = testing_support::read_text(path);
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  return bytes;
}

// Every file under a directory, by name, with its bytes.
std::map<std::string, std::string> dir_files(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    files[entry.path().filename().string()] = testing_support::read_text(entry.path());
  }
  return files;
}

// A quantized Qwen4Exp (experts only, and all linear layers) and Llama in every format load on the
// CPU backend; the last position's logits are finite, and their spread is within a factor 3 of the
// float model's (same seed): the random codes and scales keep the activations as sane as the
// float initialiser's weights do.
TEST(SynthQuantCheckpoint, LoadsAndRunsOnTheCpuBackend) {
  testing_support::TempDir tmp;
  struct Family {
    const char* name;
    SynthCheckpointOptions options;
    std::vector<SynthQuantScope> scopes;
  };
  const Family families[] = {
      {"qwen4exp", small_qwen4exp(), {SynthQuantScope::kExperts, SynthQuantScope::kAllLinear}},
      {"llama", small_llama(), {SynthQuantScope::kAllLinear}},
  };
  for (const Family& family : families) {
    const fs::path float_dir = tmp.path() / cat(family.name, "_float");
    ASSERT_TRUE(write_synth_checkpoint(float_dir, family.options).ok());
    const std::vector<float> reference = last_logits(float_dir);
    ASSERT_FALSE(reference.empty());
    for (const QuantCase& c : kCases) {
      for (const SynthQuantScope scope : family.scopes) {
        const std::string label =
            cat(family.name, "_", c.name, scope == SynthQuantScope::kExperts ? "_experts" : "_all");
        SCOPED_TRACE(label);
        const fs::path dir = tmp.path() / label;
        const Status written = write_synth_checkpoint(dir, with_quant(family.options, c, scope));
        ASSERT_TRUE(written.ok()) << written.message();
        Result<Checkpoint> ckpt = Checkpoint::open(dir);
        ASSERT_TRUE(ckpt.ok()) << ckpt.message();
        const std::vector<std::string> modules = quantized_modules(*ckpt);
        for (const std::string& module : modules) {
          if (scope == SynthQuantScope::kExperts) {
            EXPECT_NE(module.find(".mlp.experts."), std::string::npos) << module;
          }
        }
        // Experts: 4 layers x 8 experts x gate and up (down's 32 columns are fewer than AWQ g64's
        // group, and stay dense) or all three; all linear adds attention, DeltaNet, shared experts.
        EXPECT_GE(modules.size(), scope == SynthQuantScope::kExperts ? 64u : 10u);
        const std::vector<float> logits = last_logits(dir);
        ASSERT_EQ(logits.size(), reference.size());
        EXPECT_TRUE(std::all_of(logits.begin(), logits.end(),
                                [](float x) { return std::isfinite(x); }));
        const double ratio = rms(logits) / rms(reference);
        EXPECT_GT(ratio, 1.0 / 3.0);
        EXPECT_LT(ratio, 3.0);
        std::printf("[ %s ] %zu quantized modules, logits rms %.3g (float model %.3g)\n",
                    label.c_str(), modules.size(), rms(logits), rms(reference));
      }
    }
  }
}

// Each quantized weight, loaded by WeightLoader::load_linear and dequantized by
// quant/dequantize.h, has the float initialiser's magnitude: the float checkpoint with the same
// seed holds that module as uniform values in +-1/sqrt(in). Its RMS is within a factor 1.5 of the
// float weight's, the mean is within a tenth of the RMS of zero, and no value is more than 1.07
// times the float weight's bound (AWQ's 8 steps of bound / 7.5 are the largest). AWQ zero points
// are 7 or 8 (a group centred on zero); symmetric AWQ codes are 1..15 (-7..7 around the implicit
// zero 8, as round-to-nearest of a symmetric range gives).
TEST(SynthQuantCheckpoint, DequantizedWeightsHaveTheFloatInitialisersMagnitude) {
  testing_support::TempDir tmp;
  const SynthCheckpointOptions base = small_qwen4exp();
  const fs::path float_dir = tmp.path() / "float";
  ASSERT_TRUE(write_synth_checkpoint(float_dir, base).ok());
  Result<Checkpoint> reference = Checkpoint::open(float_dir);
  ASSERT_TRUE(reference.ok()) << reference.message();
  auto backend = make_cpu_backend();
  WeightLoader float_loader(*reference, *backend, "test");
  for (const QuantCase& c : kCases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = tmp.path() / c.name;
    ASSERT_TRUE(write_synth_checkpoint(dir, with_quant(base, c, SynthQuantScope::kAllLinear)).ok());
    Result<Checkpoint> ckpt = Checkpoint::open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    WeightLoader loader(*ckpt, *backend, "test");
    const std::vector<std::string> modules = quantized_modules(*ckpt);
    ASSERT_GT(modules.size(), 80u);
    double worst_low = 1e9, worst_high = 0;
    for (const std::string& module : modules) {
      const SafetensorsTensor* dense = reference->find(module + ".weight");
      ASSERT_NE(dense, nullptr) << module;
      const int64_t out = dense->shape[0];
      const int64_t in = dense->shape[1];
      Result<LinearWeight> w = loader.load_linear(module, out, in, "test");
      ASSERT_TRUE(w.ok()) << w.message();
      ASSERT_NE(w->format(), WeightFormat::kDense) << module;
      std::vector<float> got(size_t(out * in));
      dequantize_rows(w->view(), 0, out, got.data());
      Result<LinearWeight> f = float_loader.load_linear(module, out, in, "test");
      ASSERT_TRUE(f.ok()) << f.message();
      std::vector<float> want(size_t(out * in));
      dequantize_rows(f->view(), 0, out, want.data());

      const double bound = 1.0 / std::sqrt(double(in));
      double mean = 0, max_abs = 0;
      for (float x : got) {
        ASSERT_TRUE(std::isfinite(x)) << module;
        mean += x;
        max_abs = std::max(max_abs, double(std::fabs(x)));
      }
      mean /= double(got.size());
      const double ratio = rms(got) / rms(want);
      worst_low = std::min(worst_low, ratio);
      worst_high = std::max(worst_high, ratio);
      EXPECT_GT(ratio, 1.0 / 1.5) << module;
      EXPECT_LT(ratio, 1.5) << module;
      EXPECT_LT(std::fabs(mean), 0.1 * rms(got)) << module;
      EXPECT_LE(max_abs, 1.07 * bound) << module;
      if (c.quant == SynthQuant::kAwq && c.zero_point) {
        const auto* zeros = static_cast<const uint8_t*>(w->view().zeros);
        ASSERT_NE(zeros, nullptr);
        const int64_t n = out * (in / c.group);
        EXPECT_TRUE(std::all_of(zeros, zeros + n, [](uint8_t z) { return z == 7 || z == 8; }));
        EXPECT_TRUE(std::any_of(zeros, zeros + n, [](uint8_t z) { return z == 7; }));
        EXPECT_TRUE(std::any_of(zeros, zeros + n, [](uint8_t z) { return z == 8; }));
      }
      if (c.quant == SynthQuant::kAwq && !c.zero_point) {
        EXPECT_EQ(w->view().zeros, nullptr);
        const auto* codes = static_cast<const uint8_t*>(w->view().data);
        const int64_t n = out * in / 2;
        EXPECT_TRUE(std::none_of(codes, codes + n, [](uint8_t b) {
          return (b & 0x0F) == 0 || (b >> 4) == 0;
        })) << module;
      }
    }
    std::printf("[ %s ] dequantized RMS / float RMS in [%.3f, %.3f] over %zu modules\n", c.name,
                worst_low, worst_high, modules.size());
  }
}

// The streaming writer (threads generating chunks into pre-sized files) writes the same bytes as
// io/safetensors.h's writer given make_synth_checkpoint's tensors, sharded by count and by size,
// with tensors larger than one chunk (the 4 MiB embedding and lm_head of a 40000-word
// vocabulary); the index maps every tensor to its shard with the data's total size.
TEST(SynthQuantCheckpoint, StreamingWriterMatchesTheInMemoryCheckpoint) {
  testing_support::TempDir tmp;
  SynthCheckpointOptions sharded = with_quant(small_qwen4exp(), kCases[0], SynthQuantScope::kExperts);
  sharded.n_shards = 3;
  sharded.n_threads = 3;
  SynthCheckpointOptions by_size = with_quant(small_llama(), kCases[3], SynthQuantScope::kAllLinear);
  by_size.vocab_size = 40000;
  by_size.hidden_size = 64;
  by_size.dtype = DType::kBF16;
  by_size.max_shard_bytes = 3000000;
  by_size.n_threads = 2;
  SynthCheckpointOptions one_file = with_quant(small_llama(), kCases[2], SynthQuantScope::kAllLinear);
  const std::pair<const char*, SynthCheckpointOptions> cases[] = {
      {"sharded", sharded}, {"by_size", by_size}, {"one_file", one_file}};
  for (const auto& [name, options] : cases) {
    SCOPED_TRACE(name);
    const fs::path streamed = tmp.path() / cat(name, "_streamed");
    const Status written = write_synth_checkpoint(streamed, options);
    ASSERT_TRUE(written.ok()) << written.message();
    Result<SynthCheckpoint> memory = make_synth_checkpoint(options);
    ASSERT_TRUE(memory.ok()) << memory.message();
    EXPECT_EQ(testing_support::read_text(streamed / "config.json"), memory->config_json);
    const fs::path direct = tmp.path() / cat(name, "_direct");
    fs::create_directories(direct);
    uint64_t total = 0;
    for (size_t k = 0; k < memory->shard_names.size(); ++k) {
      std::vector<SafetensorsWriteTensor> shard;
      for (size_t i = 0; i < memory->tensors.size(); ++i) {
        if (memory->shard_of[i] != k) continue;
        const SynthTensor& t = memory->tensors[i];
        shard.push_back({t.name, t.dtype, t.shape, std::span<const std::byte>(t.data)});
        total += t.data.size();
      }
      ASSERT_TRUE(write_safetensors(direct / memory->shard_names[k], shard, {{"format", "pt"}}).ok());
      EXPECT_TRUE(file_bytes(streamed / memory->shard_names[k]) ==
                  file_bytes(direct / memory->shard_names[k]))
          << memory->shard_names[k];
    }
    const size_t n_shards = memory->shard_names.size();
    if (std::string(name) == "one_file") {
      EXPECT_EQ(n_shards, 1u);
      EXPECT_FALSE(fs::exists(streamed / "model.safetensors.index.json"));
      continue;
    }
    EXPECT_GE(n_shards, 3u);
    if (std::string(name) == "by_size") {
      for (size_t k = 0; k < n_shards; ++k) {
        uint64_t bytes = 0;
        size_t count = 0;
        for (size_t i = 0; i < memory->tensors.size(); ++i) {
          if (memory->shard_of[i] != k) continue;
          bytes += memory->tensors[i].data.size();
          ++count;
        }
        EXPECT_TRUE(bytes <= options.max_shard_bytes || count == 1) << k << ": " << bytes;
      }
    }
    Result<nlohmann::json> index = parse_json(
        testing_support::read_text(streamed / "model.safetensors.index.json"), "index");
    ASSERT_TRUE(index.ok()) << index.message();
    EXPECT_EQ((*index)["metadata"]["total_size"].get<uint64_t>(), total);
    const nlohmann::json& map = (*index)["weight_map"];
    ASSERT_EQ(map.size(), memory->tensors.size());
    for (size_t i = 0; i < memory->tensors.size(); ++i) {
      EXPECT_EQ(map[memory->tensors[i].name].get<std::string>(),
                memory->shard_names[memory->shard_of[i]]);
    }
    // Nothing else is left beside the files (no partial shards).
    for (const auto& entry : fs::directory_iterator(streamed)) {
      EXPECT_EQ(entry.path().filename().string().find(".partial"), std::string::npos);
    }
  }
}

// Two runs give the same bytes whatever the number of threads; another seed changes the codes.
TEST(SynthQuantCheckpoint, BytesAreDeterministic) {
  testing_support::TempDir tmp;
  for (const QuantCase& c : kCases) {
    SCOPED_TRACE(c.name);
    SynthCheckpointOptions o = with_quant(small_qwen4exp(), c, SynthQuantScope::kAllLinear);
    o.n_shards = 2;
    o.n_threads = 1;
    const fs::path a = tmp.path() / cat(c.name, "_a");
    ASSERT_TRUE(write_synth_checkpoint(a, o).ok());
    o.n_threads = 4;
    const fs::path b = tmp.path() / cat(c.name, "_b");
    ASSERT_TRUE(write_synth_checkpoint(b, o).ok());
    o.seed = 1;
    const fs::path other = tmp.path() / cat(c.name, "_seed1");
    ASSERT_TRUE(write_synth_checkpoint(other, o).ok());
    const auto files_a = dir_files(a);
    EXPECT_EQ(files_a.size(), 4u);  // config, 2 shards, index
    EXPECT_TRUE(files_a == dir_files(b));
    const auto files_other = dir_files(other);
    EXPECT_EQ(files_a.at("config.json"), files_other.at("config.json"));
    EXPECT_NE(files_a.at("model-00001-of-00002.safetensors"),
              files_other.at("model-00001-of-00002.safetensors"));
  }
}

// config.json's quantization_config reads back (quant/quant_config.h) as the method, group and
// zero point asked for, and its exclusion list names exactly the linear modules left dense (2-D
// float .weight tensors that are not embeddings or norms, found from the tensors) and lm_head.
TEST(SynthQuantCheckpoint, QuantizationConfigParses) {
  testing_support::TempDir tmp;
  for (const QuantCase& c : kCases) {
    for (const SynthQuantScope scope : {SynthQuantScope::kExperts, SynthQuantScope::kAllLinear}) {
      SCOPED_TRACE(cat(c.name, scope == SynthQuantScope::kExperts ? " experts" : " all-linear"));
      const fs::path dir = tmp.path() / cat(c.name, int(scope));
      ASSERT_TRUE(write_synth_checkpoint(dir, with_quant(small_qwen4exp(), c, scope)).ok());
      Result<nlohmann::json> config =
          parse_json(testing_support::read_text(dir / "config.json"), "config.json");
      ASSERT_TRUE(config.ok());
      Result<QuantConfig> q = parse_quant_config(*config, "config.json");
      ASSERT_TRUE(q.ok()) << q.message();
      const QuantMethod method = c.quant == SynthQuant::kAwq     ? QuantMethod::kAwq
                                 : c.quant == SynthQuant::kNvfp4 ? QuantMethod::kNvfp4
                                                                 : QuantMethod::kFp8Block;
      EXPECT_EQ(q->method, method);
      EXPECT_EQ(q->group_size, c.quant == SynthQuant::kNvfp4 ? 16 : c.group);
      if (c.quant == SynthQuant::kFp8Block) {
        EXPECT_EQ(q->block_rows, c.group);
      }
      EXPECT_EQ(q->zero_point, c.zero_point);
      Result<Checkpoint> ckpt = Checkpoint::open(dir);
      ASSERT_TRUE(ckpt.ok()) << ckpt.message();
      EXPECT_EQ(ckpt->config().quant.method, method);
      std::set<std::string> dense = {"lm_head"};
      for (const std::string& name : ckpt->tensor_names()) {
        const SafetensorsTensor* t = ckpt->find(name);
        if (!name.ends_with(".weight") || t->shape.size() != 2 || t->dtype != DType::kF16) continue;
        const std::string module = name.substr(0, name.size() - 7);
        if (module.find("embed") != std::string::npos || module.ends_with("norm")) continue;
        dense.insert(module);
      }
      EXPECT_EQ(std::set<std::string>(q->excluded.begin(), q->excluded.end()), dense);
      EXPECT_TRUE(std::is_sorted(q->excluded.begin(), q->excluded.end()));
    }
  }
}

// The published Qwen4Exp shape with AWQ group-32 experts, laid out without generating anything:
// the routed experts' bytes are the AWQ packing's by hand (per [512, 2048] or [2048, 512] module:
// qweight in * out / 2, qzeros in * out / 64, scales in * out / 16 bytes), every other tensor
// stays FP16, the shards hold at most 4 GB, and the printed plan lists the kinds.
TEST(SynthQuantCheckpoint, PublishedPlanAddsUp) {
  SynthCheckpointOptions o = published_qwen4exp_options();
  o.quant = SynthQuant::kAwq;
  o.quant_group = 32;
  o.quant_scope = SynthQuantScope::kExperts;
  Result<SynthPlan> plan = plan_synth_checkpoint(o);
  ASSERT_TRUE(plan.ok()) << plan.message();
  const uint64_t per_module = 2048ull * 512 / 2 + 2048ull * 512 / 64 + 2048ull * 512 / 16;
  const uint64_t experts_want = 48ull * 512 * 3 * per_module;
  uint64_t experts = 0, total = 0;
  size_t expert_tensors = 0;
  std::vector<uint64_t> shard_bytes(plan->shard_names.size());
  for (const SynthPlanTensor& t : plan->tensors) {
    total += t.bytes;
    shard_bytes[t.shard] += t.bytes;
    if (t.name.find(".mlp.experts.") != std::string::npos) {
      experts += t.bytes;
      ++expert_tensors;
    } else if (t.dtype != DType::kF32) {
      EXPECT_EQ(t.dtype, DType::kF16) << t.name;
    }
  }
  EXPECT_EQ(experts, experts_want);
  EXPECT_EQ(expert_tensors, size_t(48 * 512 * 3 * 3));
  EXPECT_EQ(total, plan->total_bytes);
  EXPECT_GT(plan->shard_names.size(), size_t(experts_want / 4000000000ull));
  for (uint64_t bytes : shard_bytes) EXPECT_LE(bytes, 4000000000ull);
  const std::string text = format_synth_plan(*plan);
  EXPECT_NE(text.find("model.layers.*.mlp.experts.*.gate_proj.qweight"), std::string::npos);
  EXPECT_NE(text.find("routed experts"), std::string::npos);
  EXPECT_NE(text.find(cat(plan->total_bytes, " bytes")), std::string::npos);
  Result<nlohmann::json> config = parse_json(plan->config_json, "config.json");
  ASSERT_TRUE(config.ok());
  EXPECT_EQ((*config)["num_experts"], 512);
  EXPECT_EQ((*config)["num_experts_per_tok"], 10);
  EXPECT_EQ((*config)["vocab_size"], 248320);
  EXPECT_EQ((*config)["quantization_config"]["group_size"], 32);
  std::printf("%s", text.c_str());
}

// The plan agrees with what `e4kv capacity` reads from the written headers (kv/weight_memory.h):
// the device bytes are the plan's, less the PLE n-gram table (host memory), plus AWQ's zero points
// widened to a byte each (twice the packed qzeros); the routed experts with their router are the
// moe_experts kind.
TEST(SynthQuantCheckpoint, PlanAgreesWithTheCapacityMemoryPlan) {
  testing_support::TempDir tmp;
  const SynthCheckpointOptions o =
      with_quant(small_qwen4exp(), kCases[0], SynthQuantScope::kExperts);
  Result<SynthPlan> plan = plan_synth_checkpoint(o);
  ASSERT_TRUE(plan.ok()) << plan.message();
  ASSERT_TRUE(write_synth_checkpoint(tmp.path() / "q", o).ok());
  Result<WeightMemory> memory = weight_memory(tmp.path() / "q");
  ASSERT_TRUE(memory.ok()) << memory.message();
  int64_t ple_table = 0, qzeros = 0, experts = 0;
  for (const SynthPlanTensor& t : plan->tensors) {
    if (t.name.ends_with("ngram_embedding.weight")) ple_table += int64_t(t.bytes);
    if (t.name.ends_with(".qzeros")) qzeros += int64_t(t.bytes);
    if (t.name.find(".mlp.experts.") != std::string::npos || t.name.ends_with(".mlp.gate.weight")) {
      experts += int64_t(t.bytes);
    }
  }
  ASSERT_GT(ple_table, 0);
  ASSERT_GT(qzeros, 0);
  EXPECT_EQ(memory->quantization, "awq");
  EXPECT_EQ(memory->ple_checkpoint_bytes, ple_table);
  EXPECT_EQ(memory->device_total(), int64_t(plan->total_bytes) - ple_table + qzeros);
  EXPECT_EQ(memory->device_bytes[size_t(WeightKind::kMoeExperts)], experts + qzeros);
}

// Options the loader could not read are refused before anything is made.
TEST(SynthQuantCheckpoint, RefusesWhatTheLoaderCannotRead) {
  SynthCheckpointOptions o = small_qwen4exp();
  o.quant = SynthQuant::kAwq;
  o.quant_group = 16;
  Result<SynthPlan> plan = plan_synth_checkpoint(o);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.message().find("AWQ group size must be 32, 64 or 128"), std::string::npos);
  SynthCheckpointOptions llama = small_llama();
  llama.quant = SynthQuant::kNvfp4;
  llama.quant_scope = SynthQuantScope::kExperts;
  plan = plan_synth_checkpoint(llama);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.message().find("has no experts"), std::string::npos) << plan.message();
}

}  // namespace
}  // namespace e4kv
