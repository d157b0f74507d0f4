// Runs `e4kv capacity` (E4KV_CLI_PATH) on a config.json at the seed's shapes written into a temp
// dir, and checks the JSON figures against the hand-computed ones of tests/kv/test_capacity.cpp.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/status.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

// The seed's model shapes: 48 layers, QSA every 4th (12), 2 KV heads x 256, indexer 128 / ratio 4.
constexpr const char* kSeedConfig = R"({
  "architectures": ["Qwen4ExpForCausalLM"],
  "model_type": "qwen4_exp",
  "vocab_size": 1024,
  "hidden_size": 2048,
  "num_hidden_layers": 48,
  "num_attention_heads": 16,
  "num_key_value_heads": 2,
  "head_dim": 256,
  "partial_rotary_factor": 0.25,
  "rope_theta": 10000000,
  "rms_norm_eps": 1e-6,
  "full_attention_interval": 4,
  "max_position_embeddings": 262144,
  "indexer_n_heads": 4,
  "indexer_kv_heads": 1,
  "indexer_head_dim": 128,
  "indexer_budget": 2048,
  "indexer_compress_ratio": 4
})";

class CapacityCli : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() / cat("e4kv_capacity_", ::getpid(), "_", counter++);
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "model");
    std::ofstream(dir_ / "model" / "config.json") << kSeedConfig;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  struct Run {
    int exit_code = -1;
    std::string out;
    std::string err;
  };

  Run run(const std::vector<std::string>& args) const {
    std::string command = std::string("'") + E4KV_CLI_PATH + "'";
    for (const std::string& arg : args) command += " '" + arg + "'";
    command += " >'" + (dir_ / "out.txt").string() + "' 2>'" + (dir_ / "err.txt").string() + "'";
    const int status = std::system(command.c_str());
    Run result;
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.out = read(dir_ / "out.txt");
    result.err = read(dir_ / "err.txt");
    return result;
  }

  static std::string read(const fs::path& path) {
    std::ifstream in(path);
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
  }

  std::string model() const { return (dir_ / "model").string(); }

  fs::path dir_;
};

TEST_F(CapacityCli, JsonAtTheSeedShapes) {
  const Run r =
      run({"capacity", model(), "--budget-gib", "40", "--request-tokens", "128001", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["n_qsa_layers"], 12);
  EXPECT_EQ(j["compress_ratio"], 4);
  EXPECT_EQ(j["block_size"], 64);
  EXPECT_EQ(j["budget_bytes"], 42949672960LL);
  EXPECT_EQ(j["bytes_per_token_fp16"], 25344.0);
  EXPECT_EQ(j["bytes_per_token_e4m3"], 13056.0);
  EXPECT_EQ(j["block_bytes_fp16"], 1622016);
  EXPECT_EQ(j["block_bytes_e4m3"], 835584);
  EXPECT_EQ(j["ring_bytes_per_seq"], 12288);
  // The 36 GatedDeltaNet layers' states at the class defaults (16 key / 32 value heads of 128,
  // conv 4): 36 * ((4 - 1) * 8192 * 2 + 32 * 128 * 128 * 4) = 36 * 2,146,304 = 77,266,944.
  EXPECT_EQ(j["state_bytes_per_seq"], 77266944);
  EXPECT_EQ(j["bytes_per_seq"], 77279232);
  // (42,949,672,960 - 77,279,232) / 1,622,016 = 26431.3 -> 26,431 blocks = 1,691,584 tokens;
  // (42,949,672,960 - 77,279,232) /   835,584 = 51308.0 -> 51,308 blocks = 3,283,712 tokens.
  EXPECT_EQ(j["tokens_fp16"], 1691584);
  EXPECT_EQ(j["tokens_e4m3"], 3283712);
  EXPECT_NEAR(j["ratio"].get<double>(), 3283712.0 / 1691584.0, 1e-12);
  EXPECT_GT(j["ratio"].get<double>(), 1.83);
  EXPECT_EQ(j["request_tokens"], 128001);
  // A request: 2001 blocks + 77,279,232 bytes of rings and states.
  EXPECT_NEAR(j["max_concurrency_fp16"].get<double>(), 42949672960.0 / 3322933248.0, 1e-9);
  EXPECT_NEAR(j["max_concurrency_e4m3"].get<double>(), 42949672960.0 / 1749282816.0, 1e-9);
  EXPECT_EQ(j["max_requests_fp16"], 12);
  EXPECT_EQ(j["max_requests_e4m3"], 24);
  std::printf(
      "[ capacity ] e4kv capacity --budget-gib 40: %lld FP16 vs %lld E4M3 tokens (%.4fx); "
      "128001-token requests %.2fx vs %.2fx\n",
      j["tokens_fp16"].get<long long>(), j["tokens_e4m3"].get<long long>(),
      j["ratio"].get<double>(), j["max_concurrency_fp16"].get<double>(),
      j["max_concurrency_e4m3"].get<double>());
}

TEST_F(CapacityCli, DefaultsAndTextOutput) {
  // Without --request-tokens the concurrency is for max_position_embeddings (262,144 tokens).
  Run r = run({"capacity", model(), "--budget-gib", "1", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["request_tokens"], 262144);
  // (1 GiB - 77,279,232) / 1,622,016 -> 614 blocks; / 835,584 -> 1192 blocks.
  EXPECT_EQ(j["tokens_fp16"], 39296);
  EXPECT_EQ(j["tokens_e4m3"], 76288);
  r = run({"capacity", model(), "--budget-gib", "1", "--block-size", "16"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Blocks of 16: 405,504 / 208,896 bytes -> 2457 / 4770 blocks = 39,312 / 76,320 tokens.
  EXPECT_NE(r.out.find("E4M3 holds 1.941x the tokens of FP16"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("39312"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("per sequence: 77279232 bytes (12288 QSA raw rings, 77266944 recurrent"),
            std::string::npos)
      << r.out;
}

TEST_F(CapacityCli, BadInputIsOneErrorLine) {
  Run r = run({"capacity", model(), "--budget-gib", "1", "--block-size", "24"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("e4kv: error:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("multiple of 16"), std::string::npos) << r.err;
  r = run({"capacity", model(), "--budget-gib", "-2"});
  EXPECT_NE(r.exit_code, 0);
  r = run({"capacity", (dir_ / "missing").string(), "--budget-gib", "1"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("config.json"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace e4kv
