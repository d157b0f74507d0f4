// What several model tests run the same way: the logits of one prompt in one forward (with a
// sequence slot, so hybrid models run too), the greedy continuation after it, and the quantized
// test cases of tests/data/quant.
#pragma once

#include <algorithm>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "engine/generate.h"
#include "model/model.h"

namespace e4kv::testing_support {

inline const std::filesystem::path& quant_data_dir() {
  static const std::filesystem::path dir =
      std::filesystem::path(E4KV_SOURCE_DIR) / "tests" / "data" / "quant";
  return dir;
}

// The case directories of tests/data/quant (each with quantized/ and dequantized/), sorted.
inline std::vector<std::string> quant_case_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(quant_data_dir(), ec)) {
    if (std::filesystem::exists(entry.path() / "quantized" / "config.json")) {
      names.push_back(entry.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The options the small test models load with: an FP16 cache of 8 blocks of 16 tokens.
inline ModelOptions small_model_options() {
  ModelOptions options;
  options.kv_cache_dtype = KvCacheDtype::kF16;
  options.block_size = 16;
  options.n_blocks = 8;
  options.max_model_len = 96;
  return options;
}

// The logits [ids.size(), vocab] of one forward over `ids` at positions 0.. (a fresh sequence).
inline Result<std::vector<float>> prompt_logits(Model& m, const std::vector<int32_t>& ids) {
  BlockAllocator allocator(m.n_blocks(), m.block_size());
  BlockTable table;
  allocator.append(table, int64_t(ids.size()));
  E4KV_ASSIGN_OR_RETURN(ScopedSequence seq, ScopedSequence::allocate(m));
  std::vector<int32_t> seqs(ids.size(), 0), pos(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) pos[i] = int32_t(i);
  const int32_t slot = seq.slot();
  return m.forward({ids, seqs, pos, {&table}, pos, std::span<const int32_t>(&slot, 1)});
}

struct PromptRun {
  std::vector<float> logits;   // prompt_logits
  std::vector<int32_t> greedy;  // n_greedy tokens after the prompt
};

// prompt_logits, then a greedy continuation of n_greedy tokens; failures are test failures.
inline PromptRun run_prompt(Model& m, const std::vector<int32_t>& ids, int64_t n_greedy) {
  PromptRun run;
  Result<std::vector<float>> logits = prompt_logits(m, ids);
  EXPECT_TRUE(logits.ok()) << logits.message();
  if (logits.ok()) run.logits = std::move(logits).value();
  GenerateOptions gen;
  gen.max_tokens = n_greedy;
  Result<GenerateResult> result = generate(m, ids, gen);
  EXPECT_TRUE(result.ok()) << result.message();
  if (result.ok()) run.greedy = result->output_ids;
  return run;
}

}  // namespace e4kv::testing_support
