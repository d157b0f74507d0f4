// FusedProjection (model/layers/fused_projection.h) on the checkpoints of tests/data/quant: the
// parts of a stacked projection, for a one-row step (one launch per run of one format) and a
// several-row step (one launch per part), against each part's own weight loaded alone
// (WeightLoader::load_linear, dequantized on the host) multiplied in double.
#include <gtest/gtest.h>

#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "io/checkpoint.h"
#include "model/layers/fused_projection.h"
#include "model/weights.h"
#include "quant/dequantize.h"
#include "testing/compare.h"
#include "testing/model_runs.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string dir;                // under tests/data/quant
  std::vector<LinearPart> parts;  // out filled from the checkpoint
  size_t stacks;                  // launches of a one-row step
};

// The parts' rows of x W^T in double, each part from its module loaded alone: [n, part rows]
// one part after another (the planar layout).
std::vector<double> reference(WeightLoader& loader, const std::vector<LinearPart>& parts,
                              int64_t in, const std::vector<float>& x, int64_t n) {
  std::vector<double> out;
  for (const LinearPart& part : parts) {
    Result<LinearWeight> w = loader.load_linear(part.module, part.out, in, part.meaning);
    EXPECT_TRUE(w.ok()) << w.message();
    if (!w.ok()) return {};
    std::vector<float> dense(size_t(part.out * in));
    dequantize_rows(w->view(), 0, part.out, dense.data());
    std::vector<RowRange> ranges = part.rows;
    if (ranges.empty()) ranges = {{0, part.out}};
    for (int64_t r = 0; r < n; ++r) {
      for (const RowRange& range : ranges) {
        for (int64_t o = range.begin; o < range.begin + range.count; ++o) {
          double acc = 0.0;
          for (int64_t k = 0; k < in; ++k) {
            acc += double(x[size_t(r * in + k)]) * double(dense[size_t(o * in + k)]);
          }
          out.push_back(acc);
        }
      }
    }
  }
  return out;
}

TEST(FusedProjection, PartsEqualEachWeightAloneForOneAndSeveralRows) {
  const std::string l0 = "model.layers.0.";
  const std::string dn = l0 + "linear_attn.";
  const std::vector<Case> cases = {
      // Every part of one format: one launch.
      {"llama_awq_g128/quantized",
       {{l0 + "self_attn.q_proj"}, {l0 + "self_attn.k_proj"}, {l0 + "self_attn.v_proj"}},
       1},
      {"llama_nvfp4/quantized", {{l0 + "mlp.gate_proj"}, {l0 + "mlp.up_proj"}}, 1},
      {"llama_awq_g128/dequantized",
       {{l0 + "self_attn.q_proj"}, {l0 + "self_attn.k_proj"}, {l0 + "self_attn.v_proj"}},
       1},
      // in_proj_b and in_proj_a left unquantized: a W4 (FP8) run, then a dense one.
      {"qwen4exp_awq_g32/quantized",
       {{dn + "in_proj_qkv"}, {dn + "in_proj_z"}, {dn + "in_proj_b"}, {dn + "in_proj_a"}},
       2},
      {"qwen4exp_fp8_block/quantized",
       {{dn + "in_proj_qkv"}, {dn + "in_proj_z"}, {dn + "in_proj_b"}, {dn + "in_proj_a"}},
       2},
      // Row ranges (a rank's share, a regrouped projection), reordered.
      {"llama_fp8_block/quantized",
       {{l0 + "self_attn.q_proj", 0, "", {{16, 16}, {0, 8}}}, {l0 + "self_attn.k_proj"}},
       1},
  };
  auto backend = make_cpu_backend();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dir);
    Result<Checkpoint> ckpt = Checkpoint::open(testing_support::quant_data_dir() / c.dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.message();
    const fs::path deq_dir =
        testing_support::quant_data_dir() / fs::path(c.dir).parent_path() / "dequantized";
    Result<Checkpoint> deq = Checkpoint::open(deq_dir);
    ASSERT_TRUE(deq.ok()) << deq.message();
    std::vector<LinearPart> parts = c.parts;
    int64_t in = 0;
    for (LinearPart& part : parts) {
      const SafetensorsTensor* t = deq->find(part.module + ".weight");
      ASSERT_NE(t, nullptr) << part.module;
      part.out = t->shape[0];
      in = t->shape[1];
      part.meaning = "test";
    }
    WeightLoader loader(*ckpt, *backend, "test");
    Result<FusedProjection> fused = FusedProjection::load(loader, in, parts);
    ASSERT_TRUE(fused.ok()) << fused.message();
    EXPECT_EQ(fused->n_stacks(), c.stacks);
    // One stack (no bias here): the whole weight as one view whose rows at each part's offset are
    // that part's view; several stacks: none.
    const std::optional<LinearView> stacked = fused->stacked_view();
    ASSERT_EQ(stacked.has_value(), c.stacks == 1);
    if (stacked.has_value()) {
      EXPECT_EQ(stacked->out, fused->total());
      EXPECT_EQ(stacked->in, in);
      for (size_t i = 0; i < fused->n_parts(); ++i) {
        const LinearView part = fused->view(i);
        const LinearView rows = stacked->rows(fused->offset(i), fused->out(i));
        EXPECT_EQ(rows.data, part.data) << i;
        EXPECT_EQ(rows.scales, part.scales) << i;
        EXPECT_EQ(rows.format, part.format) << i;
        EXPECT_EQ(rows.out, part.out) << i;
      }
    }
    for (int64_t n : {1, 3}) {
      SCOPED_TRACE(n);
      std::vector<float> x(size_t(n * in));
      for (float& v : x) v = normal(rng);
      Result<BackendBuffer> xb = backend->allocate(x.size() * 4);
      Result<BackendBuffer> yb = backend->allocate(size_t(n * fused->total()) * 4);
      ASSERT_TRUE(xb.ok() && yb.ok());
      backend->copy_from_host(xb->data(), x.data(), x.size() * 4);
      ASSERT_TRUE(fused->forward(*backend, xb->data(), n, yb->data(), DType::kF32).ok());
      std::vector<float> got(size_t(n * fused->total()));
      backend->copy_to_host(got.data(), yb->data(), got.size() * 4);
      const std::vector<double> want = reference(loader, parts, in, x, n);
      ASSERT_EQ(want.size(), got.size());
      // Parts one after another, each [n, rows]: exact but for fp32 accumulation.
      EXPECT_TRUE(test::all_close(got, want, 1e-4, 1e-4));
    }
  }
}

}  // namespace
}  // namespace e4kv
