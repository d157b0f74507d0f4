// The dense runtime on the CPU backend against a naive fp64 forward written here from the model
// definitions (plain loops, no BLAS, nothing shared with the runtime but the safetensors reader),
// over synthetic Llama / Mistral / Qwen2 / Qwen3 checkpoints: GQA groups 1, 2 and 4, tied and
// untied embeddings, QKV bias, q/k norm, RoPE default / linear / llama3 / yarn, BF16 / F16 / F32
// weights; prefill and decode steps; batch invariance; E4M3 caches and the scale gate.
//
// The reference rounds q, k and v to FP16 where the cache contract stores them (q after norm and
// RoPE, k after norm and RoPE, v as projected), so what is left between the two is fp32 vs fp64
// arithmetic: relative L2 of a few 1e-6, plus a rare FP16 rounding flip of one element.
#include "model/families/dense.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <numbers>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "io/safetensors.h"
#include "testing/compare.h"
#include "testing/files.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

using testing_support::read_text;
using testing_support::TempDir;
using testing_support::write_text;

// ---- the fp64 reference ---------------------------------------------------------------------

double decode_f16(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exponent = (h >> 10) & 0x1F;
  const int mantissa = h & 0x3FF;
  if (exponent == 0) return sign * std::ldexp(double(mantissa), -24);
  return sign * std::ldexp(double(mantissa + 1024), exponent - 25);
}

double decode_bf16(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

double round_f16(double x) {
  return double(static_cast<_Float16>(x));
}

std::vector<double> tensor_values(const SafetensorsTensor& t) {
  std::vector<double> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    const std::byte* p = t.bytes.data();
    if (t.dtype == DType::kF32) {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      out[i] = f;
    } else {
      const uint16_t bits = uint16_t(unsigned(p[2 * i]) | (unsigned(p[2 * i + 1]) << 8));
      out[i] = t.dtype == DType::kF16 ? decode_f16(bits) : decode_bf16(bits);
    }
  }
  return out;
}

struct RefModel {
  SynthCheckpointOptions o;
  double eps = 1e-6;
  std::vector<double> inv_freq;
  double attention_scaling = 1.0;
  std::map<std::string, std::vector<double>> w;

  const std::vector<double>& get(const std::string& name) const {
    auto it = w.find(name);
    E4KV_ASSERT(it != w.end(), "reference: missing " + name);
    return it->second;
  }
  bool has(const std::string& name) const { return w.count(name) != 0; }
};

// RoPE frequencies written from the published formulas (Llama 3.1, YaRN) for this test.
void reference_rope(RefModel& m) {
  const SynthCheckpointOptions& o = m.o;
  const int64_t d = o.head_dim;
  const double max_pos = 4096.0;
  for (int64_t i = 0; i < d / 2; ++i) {
    const double base_freq = std::pow(o.rope_theta, -2.0 * double(i) / double(d));
    double f = base_freq;
    if (o.rope_type == "linear") {
      f = base_freq / o.rope_factor;
    } else if (o.rope_type == "llama3") {
      const double old_len = double(o.rope_original_max_position_embeddings);
      const double wavelen = 2.0 * std::numbers::pi / base_freq;
      const double low_wavelen = old_len / 1.0;   // low_freq_factor 1
      const double high_wavelen = old_len / 4.0;  // high_freq_factor 4
      if (wavelen < high_wavelen) {
        f = base_freq;
      } else if (wavelen > low_wavelen) {
        f = base_freq / o.rope_factor;
      } else {
        const double smooth = (old_len / wavelen - 1.0) / (4.0 - 1.0);
        f = (1.0 - smooth) * base_freq / o.rope_factor + smooth * base_freq;
      }
    } else if (o.rope_type == "yarn") {
      const double old_len = double(o.rope_original_max_position_embeddings);
      const double factor = max_pos / old_len;
      auto dim_of = [&](double rotations) {
        return double(d) * std::log(old_len / (rotations * 2.0 * std::numbers::pi)) /
               (2.0 * std::log(o.rope_theta));
      };
      const double low = std::max(0.0, std::floor(dim_of(32.0)));
      double high = std::min(double(d) - 1.0, std::ceil(dim_of(1.0)));
      if (high == low) high += 0.001;
      const double ramp = std::min(1.0, std::max(0.0, (double(i) - low) / (high - low)));
      // ramp 0: extrapolate (keep base_freq), ramp 1: interpolate (base_freq / factor)
      f = base_freq * (1.0 - ramp) + base_freq / factor * ramp;
      m.attention_scaling = 0.1 * std::log(factor) + 1.0;
    }
    m.inv_freq.push_back(f);
  }
}

RefModel load_reference(const std::filesystem::path& dir, const SynthCheckpointOptions& o) {
  RefModel m;
  m.o = o;
  Result<SafetensorsFile> file = SafetensorsFile::open(dir / "model.safetensors");
  E4KV_ASSERT(file.ok(), file.message());
  for (const SafetensorsTensor& t : file->tensors()) m.w[t.name] = tensor_values(t);
  reference_rope(m);
  return m;
}

// y = W x (+ b); W: [out, in]
std::vector<double> matvec(const std::vector<double>& W, const std::vector<double>& x, int64_t out,
                           const std::vector<double>* bias = nullptr) {
  const int64_t in = int64_t(x.size());
  std::vector<double> y(size_t(out), 0.0);
  for (int64_t o = 0; o < out; ++o) {
    double sum = 0.0;
    for (int64_t j = 0; j < in; ++j) sum += W[size_t(o * in + j)] * x[size_t(j)];
    y[size_t(o)] = sum + (bias != nullptr ? (*bias)[size_t(o)] : 0.0);
  }
  return y;
}

std::vector<double> rms_norm(const std::vector<double>& x, const double* w, size_t begin, size_t n,
                             double eps) {
  double ss = 0.0;
  for (size_t j = 0; j < n; ++j) ss += x[begin + j] * x[begin + j];
  const double r = 1.0 / std::sqrt(ss / double(n) + eps);
  std::vector<double> out(n);
  for (size_t j = 0; j < n; ++j) out[j] = x[begin + j] * r * w[j];
  return out;
}

// Logits [n_tokens][vocab] of a whole sequence, causal, positions 0..n-1.
std::vector<std::vector<double>> reference_forward(const RefModel& m,
                                                   const std::vector<int32_t>& ids) {
  const SynthCheckpointOptions& o = m.o;
  const int64_t H = o.hidden_size, D = o.head_dim, NH = o.n_heads, NKV = o.n_kv_heads;
  const int64_t group = NH / NKV;
  const size_t T = ids.size();
  std::vector<std::vector<double>> x(T, std::vector<double>(size_t(H)));
  const std::vector<double>& embed = m.get("model.embed_tokens.weight");
  for (size_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < H; ++j) x[t][size_t(j)] = embed[size_t(ids[t] * H + j)];
  }
  for (int64_t l = 0; l < o.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    std::vector<std::vector<double>> q(T), k(T), v(T);
    for (size_t t = 0; t < T; ++t) {
      const std::vector<double> h =
          rms_norm(x[t], m.get(p + "input_layernorm.weight").data(), 0, size_t(H), m.eps);
      const bool bias = m.has(p + "self_attn.q_proj.bias");
      q[t] = matvec(m.get(p + "self_attn.q_proj.weight"), h, NH * D,
                    bias ? &m.get(p + "self_attn.q_proj.bias") : nullptr);
      k[t] = matvec(m.get(p + "self_attn.k_proj.weight"), h, NKV * D,
                    bias ? &m.get(p + "self_attn.k_proj.bias") : nullptr);
      v[t] = matvec(m.get(p + "self_attn.v_proj.weight"), h, NKV * D,
                    bias ? &m.get(p + "self_attn.v_proj.bias") : nullptr);
      if (m.has(p + "self_attn.q_norm.weight")) {
        for (int64_t hd = 0; hd < NH; ++hd) {
          const auto normed = rms_norm(q[t], m.get(p + "self_attn.q_norm.weight").data(),
                                       size_t(hd * D), size_t(D), m.eps);
          std::copy(normed.begin(), normed.end(), q[t].begin() + hd * D);
        }
        for (int64_t hd = 0; hd < NKV; ++hd) {
          const auto normed = rms_norm(k[t], m.get(p + "self_attn.k_norm.weight").data(),
                                       size_t(hd * D), size_t(D), m.eps);
          std::copy(normed.begin(), normed.end(), k[t].begin() + hd * D);
        }
      }
      auto rotate = [&](std::vector<double>& vec, int64_t heads) {
        for (int64_t hd = 0; hd < heads; ++hd) {
          double* row = vec.data() + hd * D;
          for (int64_t i = 0; i < D / 2; ++i) {
            const double angle = double(t) * m.inv_freq[size_t(i)];
            const double c = std::cos(angle) * m.attention_scaling;
            const double s = std::sin(angle) * m.attention_scaling;
            const double a = row[i], b = row[i + D / 2];
            row[i] = a * c - b * s;
            row[i + D / 2] = b * c + a * s;
          }
        }
      };
      rotate(q[t], NH);
      rotate(k[t], NKV);
      for (double& e : q[t]) e = round_f16(e);
      for (double& e : k[t]) e = round_f16(e);
      for (double& e : v[t]) e = round_f16(e);
    }
    for (size_t t = 0; t < T; ++t) {
      std::vector<double> attn(size_t(NH * D), 0.0);
      for (int64_t hd = 0; hd < NH; ++hd) {
        const int64_t kvh = hd / group;
        std::vector<double> scores(t + 1);
        double mx = -1e300;
        for (size_t s = 0; s <= t; ++s) {
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            dot += q[t][size_t(hd * D + d)] * k[s][size_t(kvh * D + d)];
          }
          scores[s] = dot / std::sqrt(double(D));
          mx = std::max(mx, scores[s]);
        }
        double sum = 0.0;
        for (double& sc : scores) {
          sc = std::exp(sc - mx);
          sum += sc;
        }
        for (size_t s = 0; s <= t; ++s) {
          for (int64_t d = 0; d < D; ++d) {
            attn[size_t(hd * D + d)] += scores[s] / sum * v[s][size_t(kvh * D + d)];
          }
        }
      }
      const std::vector<double> out = matvec(m.get(p + "self_attn.o_proj.weight"), attn, H);
      for (int64_t j = 0; j < H; ++j) x[t][size_t(j)] += out[size_t(j)];
      const std::vector<double> h =
          rms_norm(x[t], m.get(p + "post_attention_layernorm.weight").data(), 0, size_t(H), m.eps);
      std::vector<double> g = matvec(m.get(p + "mlp.gate_proj.weight"), h, o.intermediate_size);
      const std::vector<double> u = matvec(m.get(p + "mlp.up_proj.weight"), h, o.intermediate_size);
      for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
      const std::vector<double> down = matvec(m.get(p + "mlp.down_proj.weight"), g, H);
      for (int64_t j = 0; j < H; ++j) x[t][size_t(j)] += down[size_t(j)];
    }
  }
  const std::vector<double>& head =
      m.has("lm_head.weight") ? m.get("lm_head.weight") : m.get("model.embed_tokens.weight");
  std::vector<std::vector<double>> logits(T);
  for (size_t t = 0; t < T; ++t) {
    const std::vector<double> xn =
        rms_norm(x[t], m.get("model.norm.weight").data(), 0, size_t(H), m.eps);
    logits[t] = matvec(head, xn, o.vocab_size);
  }
  return logits;
}

// ---- the runtime ----------------------------------------------------------------------------

struct Runtime {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<DenseModel> model;
};

Result<Runtime> load_runtime(const std::filesystem::path& dir,
                             KvCacheDtype dtype = KvCacheDtype::kF16,
                             KvScalesMode mode = KvScalesMode::kCalibrated,
                             int64_t block_size = 16) {
  Runtime rt;
  rt.backend = make_cpu_backend({2});
  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(dir));
  rt.ckpt = std::make_unique<Checkpoint>(std::move(ckpt));
  ModelOptions options;
  options.kv_cache_dtype = dtype;
  options.kv_scales_mode = mode;
  options.block_size = block_size;
  options.n_blocks = 32;
  options.max_model_len = 256;
  E4KV_ASSIGN_OR_RETURN(rt.model, DenseModel::load(*rt.ckpt, *rt.backend, options));
  return rt;
}

// One sequence fed through forwards of the given chunk sizes (positions continue); logits of
// every row, in order.
class SequenceRunner {
 public:
  explicit SequenceRunner(DenseModel& model)
      : model_(model), allocator_(model.n_blocks(), model.block_size()) {}

  std::vector<std::vector<float>> feed(const std::vector<int32_t>& ids) {
    allocator_.append(table_, int64_t(ids.size()));
    std::vector<int32_t> seq(ids.size(), 0), pos(ids.size()), rows(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      pos[i] = int32_t(table_.n_tokens - int64_t(ids.size()) + int64_t(i));
      rows[i] = int32_t(i);
    }
    ForwardBatch batch{ids, seq, pos, {&table_}, rows};
    Result<std::vector<float>> logits = model_.forward(batch);
    EXPECT_TRUE(logits.ok()) << logits.message();
    std::vector<std::vector<float>> out;
    if (!logits.ok()) return out;
    const size_t v = size_t(model_.vocab_size());
    for (size_t i = 0; i < ids.size(); ++i) {
      out.emplace_back(logits->begin() + long(i * v), logits->begin() + long((i + 1) * v));
    }
    return out;
  }

 private:
  DenseModel& model_;
  BlockAllocator allocator_;
  BlockTable table_;
};

int32_t argmax(const std::vector<float>& v) {
  return int32_t(std::max_element(v.begin(), v.end()) - v.begin());
}

std::vector<int32_t> prompt_ids(int n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, int32_t(vocab - 1));
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& id : out) id = dist(rng);
  return out;
}

double rel_l2(const std::vector<float>& got, const std::vector<double>& ref) {
  return test::compare(got, ref, 0.0, 0.0).rel_l2;
}

struct Case {
  const char* name;
  SynthFamily family;
  int64_t n_heads;
  int64_t n_kv_heads;
  DType dtype;
  bool tied;
  const char* rope;
};

SynthCheckpointOptions case_options(const Case& c) {
  SynthCheckpointOptions o;
  o.family = c.family;
  o.n_layers = 2;
  o.hidden_size = 64;
  o.intermediate_size = 128;
  o.n_heads = c.n_heads;
  o.n_kv_heads = c.n_kv_heads;
  o.head_dim = 32;
  o.vocab_size = 256;
  o.dtype = c.dtype;
  o.tie_word_embeddings = c.tied;
  o.rope_type = c.rope;
  // llama3 reads only the original context: a short one makes most frequencies scaled ones.
  // (yarn keeps 1024, so that max_position_embeddings / original = factor = 4.)
  if (o.rope_type == "llama3") o.rope_original_max_position_embeddings = 64;
  o.seed = 5;
  return o;
}

class DenseReference : public ::testing::TestWithParam<Case> {};

TEST_P(DenseReference, PrefillAndDecodeMatchFp64) {
  const Case& c = GetParam();
  TempDir tmp;
  const SynthCheckpointOptions options = case_options(c);
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), options).ok());
  Result<Runtime> rt = load_runtime(tmp.path());
  ASSERT_TRUE(rt.ok()) << rt.message();
  const RefModel ref = load_reference(tmp.path(), options);

  std::vector<int32_t> ids = prompt_ids(20, options.vocab_size, 1);
  SequenceRunner runner(*rt->model);
  std::vector<std::vector<float>> got = runner.feed(ids);
  ASSERT_EQ(got.size(), ids.size());
  std::vector<std::vector<double>> want = reference_forward(ref, ids);
  double worst = 0.0;
  for (size_t t = 0; t < ids.size(); ++t) {
    const double err = rel_l2(got[t], want[t]);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-3) << c.name << " prefill position " << t;
  }
  // Decode steps: the runtime's greedy token, one row per forward.
  for (int step = 0; step < 4; ++step) {
    ids.push_back(argmax(got.back()));
    got = runner.feed({ids.back()});
    ASSERT_EQ(got.size(), 1u);
    want = reference_forward(ref, ids);
    const double err = rel_l2(got[0], want.back());
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-3) << c.name << " decode step " << step;
  }
  RecordProperty("worst_rel_l2", std::to_string(worst));
  std::printf("[ %s ] worst relative L2 vs fp64: %.3g\n", c.name, worst);
}

INSTANTIATE_TEST_SUITE_P(
    Families, DenseReference,
    ::testing::Values(
        Case{"llama_gqa2_bf16_untied_default", SynthFamily::kLlama, 4, 2, DType::kBF16, false,
             "default"},
        Case{"llama_gqa1_f32_tied_linear", SynthFamily::kLlama, 4, 4, DType::kF32, true, "linear"},
        Case{"llama_gqa4_f16_llama3", SynthFamily::kLlama, 8, 2, DType::kF16, false, "llama3"},
        Case{"qwen2_gqa4_bf16_yarn", SynthFamily::kQwen2, 8, 2, DType::kBF16, false, "yarn"},
        Case{"qwen3_gqa2_f32_tied_default", SynthFamily::kQwen3, 4, 2, DType::kF32, true,
             "default"},
        Case{"qwen3_gqa1_bf16_yarn", SynthFamily::kQwen3, 2, 2, DType::kBF16, false, "yarn"},
        Case{"mistral_gqa2_f16_default", SynthFamily::kMistral, 4, 2, DType::kF16, false,
             "default"}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      return std::string(param_info.param.name);
    });

// The scaled RoPE types really change the numbers (a runtime ignoring them would fail the
// reference test above only if the positions were long enough; make sure they are).
TEST(DenseModel, RopeTypesChangeLogits) {
  std::map<std::string, std::vector<float>> last;
  for (const char* rope : {"default", "linear", "llama3", "yarn"}) {
    TempDir tmp;
    Case c{"", SynthFamily::kLlama, 4, 2, DType::kF32, false, rope};
    ASSERT_TRUE(write_synth_checkpoint(tmp.path(), case_options(c)).ok());
    Result<Runtime> rt = load_runtime(tmp.path());
    ASSERT_TRUE(rt.ok()) << rt.message();
    SequenceRunner runner(*rt->model);
    last[rope] = runner.feed(prompt_ids(20, 256, 1)).back();
  }
  for (const char* rope : {"linear", "llama3", "yarn"}) {
    const auto report = test::compare(last[rope], last["default"], 0.0, 0.0);
    EXPECT_GT(report.rel_l2, 1e-2) << rope;
  }
}

// ---- batch invariance -----------------------------------------------------------------------

SynthCheckpointOptions small_llama() {
  Case c{"", SynthFamily::kLlama, 4, 2, DType::kBF16, false, "default"};
  return case_options(c);
}

// ModelOptions::load_progress reports the tensor bytes taken, increasing, ending at every byte of
// the checkpoint (a model that uses every tensor), the total being the tensors' bytes.
TEST(DenseModel, LoadProgressCountsEveryTensorByte) {
  TempDir tmp;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), small_llama()).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  uint64_t tensor_bytes = 0;
  for (const std::string& name : ckpt->tensor_names())
    tensor_bytes += ckpt->find(name)->bytes.size();
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  auto backend = make_cpu_backend();
  ModelOptions options;
  options.n_blocks = 4;
  options.block_size = 16;
  options.load_progress = [&](uint64_t done, uint64_t total) { calls.emplace_back(done, total); };
  Result<std::unique_ptr<Model>> model = load_model(*ckpt, *backend, options);
  ASSERT_TRUE(model.ok()) << model.message();
  ASSERT_GE(calls.size(), 2u);
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].second, tensor_bytes);
    if (i > 0) {
      EXPECT_GT(calls[i].first, calls[i - 1].first) << "call " << i;
    }
  }
  EXPECT_EQ(calls.back().first, tensor_bytes);
}

TEST(DenseModel, PrefillInOneForwardEqualsTokenByToken) {
  TempDir tmp;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), small_llama()).ok());
  Result<Runtime> a = load_runtime(tmp.path());
  Result<Runtime> b = load_runtime(tmp.path());
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<int32_t> ids = prompt_ids(19, 256, 3);
  SequenceRunner whole(*a->model);
  SequenceRunner steps(*b->model);
  const std::vector<std::vector<float>> one = whole.feed(ids);
  ASSERT_EQ(one.size(), ids.size());
  for (size_t t = 0; t < ids.size(); ++t) {
    const std::vector<std::vector<float>> step = steps.feed({ids[t]});
    ASSERT_EQ(step.size(), 1u);
    // Only the GEMM's blocking differs with the row count: fp32 rounding, which may flip an FP16
    // rounding of one K/V element.
    EXPECT_TRUE(test::all_close(step[0], one[t], 1e-4, 1e-4)) << "position " << t;
  }
}

TEST(DenseModel, TwoSequencesInOneBatchEqualSeparateRuns) {
  TempDir tmp;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), small_llama()).ok());
  const std::vector<int32_t> a_ids = prompt_ids(21, 256, 4);
  const std::vector<int32_t> b_ids = prompt_ids(9, 256, 5);

  // Separately.
  std::vector<std::vector<float>> a_alone, b_alone;
  {
    Result<Runtime> rt = load_runtime(tmp.path());
    ASSERT_TRUE(rt.ok());
    SequenceRunner runner(*rt->model);
    a_alone = runner.feed(a_ids);
    const auto decode = runner.feed({7});
    a_alone.push_back(decode[0]);
  }
  {
    Result<Runtime> rt = load_runtime(tmp.path());
    ASSERT_TRUE(rt.ok());
    SequenceRunner runner(*rt->model);
    b_alone = runner.feed(b_ids);
  }

  // Together: A prefills its first 21 tokens, then A decodes one token while B prefills, in
  // one mixed batch (A's decode row first, then B's prompt).
  Result<Runtime> rt = load_runtime(tmp.path());
  ASSERT_TRUE(rt.ok());
  DenseModel& model = *rt->model;
  BlockAllocator allocator(model.n_blocks(), model.block_size());
  BlockTable a_table, b_table;
  allocator.append(a_table, 21);
  {
    std::vector<int32_t> seq(21, 0), pos(21), rows{20};
    for (int i = 0; i < 21; ++i) pos[size_t(i)] = i;
    ForwardBatch batch{a_ids, seq, pos, {&a_table}, rows};
    Result<std::vector<float>> logits = model.forward(batch);
    ASSERT_TRUE(logits.ok()) << logits.message();
    EXPECT_TRUE(test::all_close(*logits, a_alone[20], 1e-6, 1e-6));
  }
  allocator.append(a_table, 1);
  allocator.append(b_table, 9);
  std::vector<int32_t> ids{7}, seq{0}, pos{21}, rows;
  for (int i = 0; i < 9; ++i) {
    ids.push_back(b_ids[size_t(i)]);
    seq.push_back(1);
    pos.push_back(i);
  }
  for (int r = 0; r < 10; ++r) rows.push_back(r);
  ForwardBatch batch{ids, seq, pos, {&a_table, &b_table}, rows};
  Result<std::vector<float>> logits = model.forward(batch);
  ASSERT_TRUE(logits.ok()) << logits.message();
  const size_t v = 256;
  const std::vector<float> a_row(logits->begin(), logits->begin() + long(v));
  EXPECT_TRUE(test::all_close(a_row, a_alone[21], 1e-4, 1e-4)) << "A's decode row";
  for (size_t i = 0; i < 9; ++i) {
    const std::vector<float> b_row(logits->begin() + long((i + 1) * v),
                                   logits->begin() + long((i + 2) * v));
    EXPECT_TRUE(test::all_close(b_row, b_alone[i], 1e-4, 1e-4)) << "B position " << i;
  }
}

// ---- E4M3 cache and the scale gate ----------------------------------------------------------

// Logits of a 24-token prompt (all positions) under one cache setting.
Result<std::vector<std::vector<float>>> prompt_logits(const std::filesystem::path& dir,
                                                      KvCacheDtype dtype, KvScalesMode mode) {
  E4KV_ASSIGN_OR_RETURN(Runtime rt, load_runtime(dir, dtype, mode));
  SequenceRunner runner(*rt.model);
  return runner.feed(prompt_ids(24, 256, 9));
}

double worst_rel_l2(const std::vector<std::vector<float>>& a,
                    const std::vector<std::vector<float>>& b) {
  double worst = 0.0;
  for (size_t t = 0; t < a.size(); ++t) {
    worst = std::max(worst, test::compare(a[t], b[t], 0.0, 0.0).rel_l2);
  }
  return worst;
}

TEST(DenseModel, E4m3CacheStaysCloseToFp16) {
  TempDir tmp;
  SynthCheckpointOptions options = small_llama();
  options.with_kv_scales = true;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), options).ok());
  auto fp16 = prompt_logits(tmp.path(), KvCacheDtype::kF16, KvScalesMode::kCalibrated);
  auto unit = prompt_logits(tmp.path(), KvCacheDtype::kE4m3, KvScalesMode::kUnit);
  auto calibrated = prompt_logits(tmp.path(), KvCacheDtype::kE4m3, KvScalesMode::kCalibrated);
  ASSERT_TRUE(fp16.ok()) << fp16.message();
  ASSERT_TRUE(unit.ok()) << unit.message();
  ASSERT_TRUE(calibrated.ok()) << calibrated.message();
  const double unit_err = worst_rel_l2(*unit, *fp16);
  const double calibrated_err = worst_rel_l2(*calibrated, *fp16);
  std::printf("[ e4m3 ] worst relative L2 vs fp16 cache: unit %.3g, calibrated %.3g\n", unit_err,
              calibrated_err);
  // E4M3 keeps 3 mantissa bits: each stored K/V element carries up to 2^-4 relative error
  // (about 3.6% RMS for a uniform spread), and values below 2^-6 * scale lose bits too. Attention
  // averages these errors over keys and the residual stream dilutes them, so the logits move by a
  // few percent; 0.1 leaves room while still failing a broken cache (errors of order 1).
  EXPECT_LE(unit_err, 0.1);
  EXPECT_LE(calibrated_err, 0.1);
  // ... and the E4M3 path really ran (FP16 vs fp64 is ~1e-6).
  EXPECT_GT(unit_err, 1e-4);
  EXPECT_GT(calibrated_err, 1e-4);
}

TEST(DenseModel, CalibratedE4m3WithoutScalesFailsClosed) {
  TempDir tmp;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), small_llama()).ok());
  Result<Runtime> rt = load_runtime(tmp.path(), KvCacheDtype::kE4m3, KvScalesMode::kCalibrated);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.message().find("KV scale gate: loaded 0/4"), std::string::npos) << rt.message();
  EXPECT_NE(rt.message().find("missing: model.layers.0.self_attn.k_scale"), std::string::npos)
      << rt.message();
}

// ---- config and checkpoint checks -----------------------------------------------------------

TEST(DenseModel, ShapeMismatchNamesTheTensor) {
  TempDir tmp;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), small_llama()).ok());
  std::string config = read_text(tmp.path() / "config.json");
  const std::string from = "\"intermediate_size\": 128";
  ASSERT_NE(config.find(from), std::string::npos);
  config.replace(config.find(from), from.size(), "\"intermediate_size\": 96");
  write_text(tmp.path() / "config.json", config);
  Result<Runtime> rt = load_runtime(tmp.path());
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.message().find("model.layers.0.mlp.gate_proj.weight has shape [128, 64] but "
                              "config.json implies [96, 64]"),
            std::string::npos)
      << rt.message();
}

TEST(DenseModel, UnsupportedArchitectureIsAnError) {
  TempDir tmp;
  SynthCheckpointOptions options;
  options.family = SynthFamily::kQwen4Exp;
  options.n_layers = 4;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), options).ok());
  Result<Runtime> rt = load_runtime(tmp.path());
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.message().find("Qwen4ExpForCausalLM\" is not supported by the dense runtime"),
            std::string::npos)
      << rt.message();
}

TEST(DenseModel, MissingLmHeadWithoutTyingIsAnError) {
  TempDir tmp;
  SynthCheckpointOptions options = small_llama();
  options.tie_word_embeddings = true;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), options).ok());
  std::string config = read_text(tmp.path() / "config.json");
  const std::string from = "\"tie_word_embeddings\": true";
  config.replace(config.find(from), from.size(), "\"tie_word_embeddings\": false");
  write_text(tmp.path() / "config.json", config);
  Result<Runtime> rt = load_runtime(tmp.path());
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.message().find("lm_head.weight is missing"), std::string::npos) << rt.message();
}

TEST(DenseModel, SlidingWindowShorterThanContextIsRefused) {
  TempDir tmp;
  Case c{"", SynthFamily::kMistral, 4, 2, DType::kBF16, false, "default"};
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), case_options(c)).ok());
  Result<Checkpoint> ckpt = Checkpoint::open(tmp.path());
  ASSERT_TRUE(ckpt.ok());
  auto backend = make_cpu_backend();
  ModelOptions options;
  options.n_blocks = 4;
  options.max_model_len = 8192;  // the synthetic window is 4096
  Result<std::unique_ptr<DenseModel>> model = DenseModel::load(*ckpt, *backend, options);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.message().find("sliding window of 4096"), std::string::npos) << model.message();
  EXPECT_EQ(model.status().option(), "max_model_len");
  EXPECT_NE(model.message().find("give 4096 or less"), std::string::npos) << model.message();
}

TEST(DenseModel, ForwardRejectsBadMetadata) {
  TempDir tmp;
  ASSERT_TRUE(write_synth_checkpoint(tmp.path(), small_llama()).ok());
  Result<Runtime> rt = load_runtime(tmp.path());
  ASSERT_TRUE(rt.ok());
  BlockAllocator allocator(rt->model->n_blocks(), rt->model->block_size());
  BlockTable table;
  allocator.append(table, 2);
  std::vector<int32_t> ids{1, 999}, seq{0, 0}, pos{0, 1}, rows{1};
  Result<std::vector<float>> logits = rt->model->forward({ids, seq, pos, {&table}, rows});
  ASSERT_FALSE(logits.ok());
  EXPECT_NE(logits.message().find("token id 999 (row 1) is outside the vocabulary [0, 256)"),
            std::string::npos)
      << logits.message();
  ids[1] = 5;
  pos[1] = 2;
  logits = rt->model->forward({ids, seq, pos, {&table}, rows});
  ASSERT_FALSE(logits.ok());
  EXPECT_NE(logits.message().find("position 2"), std::string::npos) << logits.message();
}

}  // namespace
}  // namespace e4kv
