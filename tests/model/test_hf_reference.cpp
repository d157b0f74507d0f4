// The dense runtime against Hugging Face transformers: for every case directory under
// tests/data/hf (made by scripts/hf_reference_models.py on the GPU machine: a save_pretrained
// checkpoint plus reference.json with transformers' fp32 logits and a greedy continuation), the
// CPU backend with an FP16 KV cache must reproduce the logits (relative L2 <= 1e-3 overall and
// per position) and the 32 greedy tokens exactly.
//
// The bound: the runtime stores K and V (and reads q) in FP16, transformers keeps them in fp32;
// FP16 rounding is 2^-11 relative per element and averages down through attention, which puts
// the logits' relative L2 in the 1e-4 range for these models. The greedy references are drawn with
// a top-1/top-2 margin of at least 1e-3 of the logit spread, so the same rounding cannot flip them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "engine/generate.h"
#include "io/checkpoint.h"
#include "model/families/dense.h"
#include "testing/compare.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const fs::path kDataDir = fs::path(E4KV_SOURCE_DIR) / "tests" / "data" / "hf";

json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
}

std::vector<fs::path> case_dirs() {
  std::vector<fs::path> dirs;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(kDataDir, ec)) {
    if (entry.is_directory() && fs::exists(entry.path() / "reference.json")) {
      dirs.push_back(entry.path());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

Result<std::unique_ptr<DenseModel>> load(const Checkpoint& ckpt, Backend& backend, int64_t tokens) {
  ModelOptions options;
  options.kv_cache_dtype = KvCacheDtype::kF16;
  options.block_size = 16;
  options.n_blocks = (tokens + 15) / 16 + 1;
  return DenseModel::load(ckpt, backend, options);
}

void check_case(const fs::path& dir) {
  const json ref = read_json(dir / "reference.json");
  ASSERT_FALSE(ref.is_discarded()) << dir << "/reference.json is not valid JSON";
  ASSERT_TRUE(ref.contains("input_ids") && ref.contains("logits") && ref.contains("greedy"))
      << dir << "/reference.json lacks input_ids, logits or greedy";
  Result<Checkpoint> ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.message();
  Result<DenseModelSpec> spec = dense_model_spec(ckpt->config());
  ASSERT_TRUE(spec.ok()) << spec.message();
  if (ref.contains("family")) {
    EXPECT_EQ(std::string(dense_family_name(spec->family)), ref["family"].get<std::string>());
  }
  auto backend = make_cpu_backend();

  // Logits over input_ids, one forward.
  const std::vector<int32_t> ids = ref["input_ids"].get<std::vector<int32_t>>();
  const std::vector<std::vector<double>> want =
      ref["logits"].get<std::vector<std::vector<double>>>();
  ASSERT_EQ(want.size(), ids.size());
  {
    Result<std::unique_ptr<DenseModel>> model = load(*ckpt, *backend, int64_t(ids.size()));
    ASSERT_TRUE(model.ok()) << model.message();
    BlockAllocator allocator((*model)->n_blocks(), (*model)->block_size());
    BlockTable table;
    allocator.append(table, int64_t(ids.size()));
    std::vector<int32_t> seq(ids.size(), 0), pos(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) pos[i] = int32_t(i);
    Result<std::vector<float>> got = (*model)->forward({ids, seq, pos, {&table}, pos});
    ASSERT_TRUE(got.ok()) << got.message();
    const size_t vocab = size_t((*model)->vocab_size());
    std::vector<double> want_flat;
    double worst = 0.0;
    for (size_t t = 0; t < want.size(); ++t) {
      ASSERT_EQ(want[t].size(), vocab) << "position " << t;
      want_flat.insert(want_flat.end(), want[t].begin(), want[t].end());
      const std::vector<float> row(got->begin() + long(t * vocab),
                                   got->begin() + long((t + 1) * vocab));
      const double err = test::compare(row, want[t], 0.0, 0.0).rel_l2;
      worst = std::max(worst, err);
      EXPECT_LE(err, 1e-3) << "position " << t;
    }
    const double overall = test::compare(*got, want_flat, 0.0, 0.0).rel_l2;
    EXPECT_LE(overall, 1e-3);
    std::printf("[ %s ] logits relative L2: overall %.3g, worst position %.3g\n",
                dir.filename().c_str(), overall, worst);
  }

  // Greedy continuation with an FP16 cache: prefill, then one token per forward.
  const std::vector<int32_t> prompt = ref["greedy"]["prompt_ids"].get<std::vector<int32_t>>();
  const std::vector<int32_t> expected = ref["greedy"]["output_ids"].get<std::vector<int32_t>>();
  Result<std::unique_ptr<DenseModel>> model =
      load(*ckpt, *backend, int64_t(prompt.size() + expected.size()));
  ASSERT_TRUE(model.ok()) << model.message();
  GenerateOptions options;
  options.max_tokens = int64_t(expected.size());  // EOS does not stop it: the reference ran on
  Result<GenerateResult> result = generate(**model, prompt, options);
  ASSERT_TRUE(result.ok()) << result.message();
  EXPECT_EQ(result->output_ids, expected);
}

TEST(HfReference, LogitsAndGreedyMatchTransformers) {
  std::error_code ec;
  ASSERT_TRUE(fs::is_directory(kDataDir, ec))
      << kDataDir.string()
      << " does not exist: the Hugging Face reference data is missing. Generate it on the GPU "
         "machine with `python3 scripts/hf_reference_models.py` (writes tests/data/hf/<case>/) "
         "and commit it.";
  const std::vector<fs::path> dirs = case_dirs();
  ASSERT_FALSE(dirs.empty()) << kDataDir.string()
                             << " holds no case directory with a reference.json; run "
                                "scripts/hf_reference_models.py on the GPU machine";
  for (const fs::path& dir : dirs) {
    SCOPED_TRACE(dir.filename().string());
    check_case(dir);
  }
}

}  // namespace
}  // namespace e4kv
