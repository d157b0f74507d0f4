// Quantized checkpoints on the command line: inspect names the method, generate runs them and
// continues a prompt as on the dequantized checkpoint (tests/data/quant).
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "testing/cli.h"
#include "testing/files.h"
#include "testing/model_runs.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::run_cli;

TEST(CliQuantized, InspectNamesTheMethodAndGenerateMatchesTheDequantizedCheckpoint) {
  TempDir tmp;
  const fs::path dir = testing_support::quant_data_dir();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"llama_awq_g128", "AWQ W4A16 g128 (zero points)"},
      {"llama_awq_g64_sym", "AWQ W4A16 g64 (symmetric)"},
      {"llama_nvfp4", "NVFP4 (weight only)"},
      {"llama_fp8_block", "FP8 E4M3 blocks 48x48"},
      {"qwen4exp_awq_g32", "AWQ W4A16 g32 (zero points)"}};
  for (const auto& [name, method] : cases) {
    SCOPED_TRACE(name);
    const fs::path q = dir / name / "quantized";
    const RunResult inspect = run_cli(tmp.path(), {"inspect", q.string(), "--json"});
    ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
    EXPECT_EQ(nlohmann::json::parse(inspect.out)["quantization"], method);
    auto generate = [&](const fs::path& model) {
      return run_cli(tmp.path(), {"generate", model.string(), "--prompt-ids", "1,17,42,7,99",
                                  "--max-tokens", "8", "--threads", "1", "--json"});
    };
    const RunResult quantized = generate(q);
    ASSERT_EQ(quantized.exit_code, 0) << quantized.err;
    const RunResult dequantized = generate(dir / name / "dequantized");
    ASSERT_EQ(dequantized.exit_code, 0) << dequantized.err;
    EXPECT_EQ(nlohmann::json::parse(quantized.out)["output_ids"],
              nlohmann::json::parse(dequantized.out)["output_ids"]);
  }
  const RunResult plain =
      run_cli(tmp.path(), {"inspect", (dir / "llama_nvfp4" / "dequantized").string(), "--json"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(nlohmann::json::parse(plain.out)["quantization"], "none");
}

}  // namespace
}  // namespace e4kv
