// The weight formats' definitions against hand-computed values, and config.json's
// quantization_config: what is read and what is refused.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/json.h"
#include "quant/dequantize.h"
#include "quant/quant_config.h"

namespace e4kv {
namespace {

TEST(Dequantize, W4WithZerosAndSymmetric) {
  // One row of 4 columns in groups of 2: codes 0, 15 | 7, 8; scales 0.5, 2; zeros 3, 8.
  const uint8_t data[2] = {uint8_t(0x0 | (0xF << 4)), uint8_t(0x7 | (0x8 << 4))};
  const uint16_t scales[2] = {f32_to_f16(0.5f), f32_to_f16(2.0f)};
  const uint8_t zeros[2] = {3, 8};
  LinearView w;
  w.format = WeightFormat::kW4;
  w.out = 1;
  w.in = 4;
  w.group = 2;
  w.data = data;
  w.scales = scales;
  w.zeros = zeros;
  float got[4];
  dequantize_rows(w, 0, 1, got);
  EXPECT_EQ(got[0], (0.0f - 3.0f) * 0.5f);
  EXPECT_EQ(got[1], (15.0f - 3.0f) * 0.5f);
  EXPECT_EQ(got[2], (7.0f - 8.0f) * 2.0f);
  EXPECT_EQ(got[3], (8.0f - 8.0f) * 2.0f);
  w.zeros = nullptr;  // symmetric: every zero 8
  dequantize_rows(w, 0, 1, got);
  EXPECT_EQ(got[0], -8.0f * 0.5f);
  EXPECT_EQ(got[1], 7.0f * 0.5f);
}

TEST(Dequantize, Nvfp4CodesScalesAndPerRowGlobals) {
  const std::vector<float> want_table = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0f, -0.5, -1, -1.5, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1_values()[size_t(c)], want_table[size_t(c)]) << c;
  // Two rows of 16 columns; row r holds codes c = k (k < 16) with E4M3 scale code 0x38 (1.0) for
  // row 0 and 0x40 (2.0) for row 1; globals 4 and 0.5.
  std::vector<uint8_t> data(16);
  for (int r = 0; r < 2; ++r) {
    for (int k = 0; k < 16; k += 2) data[size_t(r * 8 + k / 2)] = uint8_t(k | ((k + 1) << 4));
  }
  const uint8_t scales[2] = {0x38, 0x40};
  const float global[2] = {4.0f, 0.5f};
  LinearView w;
  w.format = WeightFormat::kNvfp4;
  w.out = 2;
  w.in = 16;
  w.group = 16;
  w.data = data.data();
  w.scales = scales;
  w.global = global;
  std::vector<float> got(32);
  dequantize_rows(w, 0, 2, got.data());
  for (int k = 0; k < 16; ++k) {
    EXPECT_EQ(got[size_t(k)], want_table[size_t(k)] * (1.0f / 4.0f)) << k;
    EXPECT_EQ(got[size_t(16 + k)], want_table[size_t(k)] * (2.0f / 0.5f)) << k;
  }
  // rows() keeps each row's own global.
  dequantize_rows(w.rows(1, 1), 0, 1, got.data());
  EXPECT_EQ(got[7], 6.0f * 4.0f);
}

TEST(Dequantize, Fp8BlocksWithAPartialLastBlock) {
  // One row of 3 columns, blocks of 2: scales 0.25 and 8.
  const uint8_t data[3] = {0x38, 0xB8, 0x40};  // 1.0, -1.0, 2.0
  const float scales[2] = {0.25f, 8.0f};
  LinearView w;
  w.format = WeightFormat::kFp8Block;
  w.out = 1;
  w.in = 3;
  w.group = 2;
  w.data = data;
  w.scales = scales;
  float got[3];
  dequantize_rows(w, 0, 1, got);
  EXPECT_EQ(got[0], 0.25f);
  EXPECT_EQ(got[1], -0.25f);
  EXPECT_EQ(got[2], 16.0f);
  EXPECT_EQ(w.scale_row_bytes(), 8);
  EXPECT_EQ(w.bytes(), 3 + 8);
}

Result<QuantConfig> parse(const std::string& text) {
  Result<nlohmann::json> root = parse_json(text, "config.json");
  if (!root.ok()) return root.status();
  return parse_quant_config(*root, "config.json");
}

TEST(QuantConfig, ReadsTheThreeToolsForms) {
  Result<QuantConfig> none = parse(R"({"hidden_size": 8})");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->quantized());
  Result<QuantConfig> awq = parse(R"({"quantization_config": {"quant_method": "awq", "bits": 4,
      "group_size": 32, "zero_point": false, "version": "GEMM", "modules_to_not_convert": ["gate"]}})");
  ASSERT_TRUE(awq.ok()) << awq.message();
  EXPECT_EQ(awq->method, QuantMethod::kAwq);
  EXPECT_EQ(awq->group_size, 32);
  EXPECT_FALSE(awq->zero_point);
  EXPECT_EQ(awq->excluded, std::vector<std::string>{"gate"});
  EXPECT_EQ(awq->describe(), "AWQ W4A16 g32 (symmetric)");
  Result<QuantConfig> nested = parse(R"({"text_config": {"quantization_config": {
      "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups":
      {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
      "group_size": 16, "strategy": "tensor_group"}}}, "ignore": ["lm_head"]}}})");
  ASSERT_TRUE(nested.ok()) << nested.message();
  EXPECT_EQ(nested->method, QuantMethod::kNvfp4);
  EXPECT_EQ(nested->field, "text_config.quantization_config");
  Result<QuantConfig> fp8 = parse(R"({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
      "activation_scheme": "dynamic", "weight_block_size": [128, 64]}})");
  ASSERT_TRUE(fp8.ok()) << fp8.message();
  EXPECT_EQ(fp8->method, QuantMethod::kFp8Block);
  EXPECT_EQ(fp8->block_rows, 128);
  EXPECT_EQ(fp8->group_size, 64);
}

TEST(QuantConfig, RefusesWhatItCannotRunNamingTheField) {
  struct Bad {
    const char* config;
    const char* names;
  };
  const Bad bad[] = {
      {R"({"quantization_config": {"quant_method": "gptq", "bits": 4}})", "quant_method"},
      {R"({"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 128}})", "bits"},
      {R"({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 16}})",
       "group_size"},
      {R"({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}})",
       "version"},
      {R"({"quantization_config": {"quant_method": "compressed-tensors", "format":
          "pack-quantized"}})",
       "format"},
      {R"({"quantization_config": {"quant_method": "compressed-tensors", "format":
          "nvfp4-pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 4, "type":
          "float", "group_size": 32}}}}})",
       "group_size 32"},
      {R"({"quantization_config": {"quant_method": "fp8"}})", "weight_block_size"},
      {R"({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 128]}})",
       "weight_block_size"},
      {R"({"quantization_config": "awq"})", "expected an object"},
  };
  for (const Bad& b : bad) {
    Result<QuantConfig> q = parse(b.config);
    ASSERT_FALSE(q.ok()) << b.config;
    EXPECT_NE(q.message().find(b.names), std::string::npos) << q.message();
    EXPECT_EQ(q.message().rfind("config.json: ", 0), 0u) << q.message();
  }
}

}  // namespace
}  // namespace e4kv
