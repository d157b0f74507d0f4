// scales.json: round trip (exact fp32), canonical keys, and every malformed input named.
#include "calib/scales_file.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "kv/scale_gate.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

class ScalesFileTest : public ::testing::Test {
 protected:
  ScalesFileTest() {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() / cat("e4kv_scales_file_", ::getpid(), "_", counter++);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~ScalesFileTest() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path dir_;
};

std::string with_scales(const std::string& scales_body) {
  return R"({"format": "e4kv-kv-scales/1", "policy": "absmax", "scales": {)" + scales_body + "}}";
}

TEST_F(ScalesFileTest, RoundTripIsExact) {
  ScalesFile file;
  file.policy = "p99.99";
  file.source_json = R"({"stats": [{"path": "a.stats.json", "sha256": "00"}], "tokens": 123})";
  // Values that need all 9 significant digits, subnormals and extremes of fp32.
  uint32_t bits = 0x3C8C4A2Bu;
  for (int layer = 0; layer < 40; ++layer) {
    float k = 0.0f;
    std::memcpy(&k, &bits, 4);
    bits = bits * 1664525u + 1013904223u;
    bits = (bits & 0x007FFFFFu) | 0x3C000000u;  // (2^-7, 2^-6]-ish positive normals
    file.scales[cat("model.layers.", layer, ".self_attn.k_scale")] = k;
    file.scales[cat("model.layers.", layer, ".self_attn.v_scale")] =
        0.0171247218f * float(layer + 1);
  }
  // The extremes of the usable range (kv_scale_limits): fp32 values far from 1.
  file.scales["model.layers.40.self_attn.k_scale"] =
      std::nextafter(kv_scale_limits().largest_saturating, 1.0f);
  file.scales["model.layers.40.self_attn.v_scale"] =
      std::nextafter(kv_scale_limits().smallest_flushing, 1.0f);
  file.scales["model.layers.41.self_attn.k_scale"] = 1.0f;
  file.scales["model.layers.41.self_attn.v_scale"] = std::nextafter(1.0f, 2.0f);

  const fs::path path = dir_ / "scales.json";
  ASSERT_TRUE(write_scales_file(path, file).ok());
  Result<ScalesFile> read = read_scales_file(path);
  ASSERT_TRUE(read.ok()) << read.message();
  EXPECT_EQ(read->policy, "p99.99");
  EXPECT_EQ(nlohmann::json::parse(read->source_json), nlohmann::json::parse(file.source_json));
  ASSERT_EQ(read->scales.size(), file.scales.size());
  for (const auto& [key, value] : file.scales) {
    ASSERT_TRUE(read->scales.contains(key)) << key;
    uint32_t a = 0;
    uint32_t b = 0;
    const float got = read->scales.at(key);
    std::memcpy(&a, &value, 4);
    std::memcpy(&b, &got, 4);
    EXPECT_EQ(a, b) << key;
  }
  // No temporary file is left beside the output.
  int entries = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    (void)entry;
    ++entries;
  }
  EXPECT_EQ(entries, 1);
}

TEST_F(ScalesFileTest, WrittenInLayerOrderWithShortNumbers) {
  ScalesFile file;
  file.policy = "absmax";
  file.scales["model.layers.11.self_attn.k_scale"] = 0.0841238871f;
  file.scales["model.layers.3.self_attn.v_scale"] = 0.5f;
  file.scales["model.layers.3.self_attn.k_scale"] = 0.0171247218f;
  const fs::path path = dir_ / "s.json";
  ASSERT_TRUE(write_scales_file(path, file).ok());
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string s = text.str();
  // The shortest digits that read back as the same fp32.
  const size_t k3 = s.find("\"model.layers.3.self_attn.k_scale\": 0.017124722,");
  const size_t v3 = s.find("\"model.layers.3.self_attn.v_scale\": 0.5,");
  const size_t k11 = s.find("\"model.layers.11.self_attn.k_scale\": 0.08412389\n");
  ASSERT_NE(k3, std::string::npos) << s;
  ASSERT_NE(v3, std::string::npos) << s;
  ASSERT_NE(k11, std::string::npos) << s;
  EXPECT_LT(k3, v3);
  EXPECT_LT(v3, k11);
  EXPECT_TRUE(contains(s, "\"format\": \"e4kv-kv-scales/1\"")) << s;
}

TEST_F(ScalesFileTest, WriteRefusesBadScales) {
  ScalesFile file;
  file.scales["model.layers.0.self_attn.k_proj.k_scale"] = 0.5f;
  EXPECT_TRUE(contains(write_scales_file(dir_ / "a.json", file).message(), "canonical"));
  file.scales.clear();
  file.scales["model.layers.0.self_attn.k_scale"] = std::nanf("");
  EXPECT_TRUE(contains(write_scales_file(dir_ / "a.json", file).message(), "not finite"));
  file.scales["model.layers.0.self_attn.k_scale"] = -0.0f;
  EXPECT_TRUE(contains(write_scales_file(dir_ / "a.json", file).message(), "is not > 0"));
  file.scales["model.layers.0.self_attn.k_scale"] = std::numeric_limits<float>::denorm_min();
  EXPECT_TRUE(contains(write_scales_file(dir_ / "a.json", file).message(), "is too small"));
  file.scales["model.layers.0.self_attn.k_scale"] = std::numeric_limits<float>::max();
  EXPECT_TRUE(contains(write_scales_file(dir_ / "a.json", file).message(), "is too large"));
  file.scales["model.layers.0.self_attn.k_scale"] = 0.5f;
  file.source_json = "[1]";
  EXPECT_TRUE(contains(write_scales_file(dir_ / "a.json", file).message(), "JSON object"));
  EXPECT_FALSE(fs::exists(dir_ / "a.json"));
}

TEST(ScalesFileParse, AliasesBecomeCanonical) {
  Result<ScalesFile> file =
      parse_scales_file(with_scales(R"("model.layers.3.self_attn.k_proj.k_scale": 0.25,
                                        "model.layers.3.self_attn.attn.v_scale": 2)"),
                        "s.json");
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_EQ(file->scales.at("model.layers.3.self_attn.k_scale"), 0.25f);
  EXPECT_EQ(file->scales.at("model.layers.3.self_attn.v_scale"), 2.0f);
  EXPECT_EQ(file->policy, "absmax");
  EXPECT_EQ(file->source_json, "{}");
}

TEST(ScalesFileParse, BadInputsAreNamed) {
  struct Case {
    std::string text;
    std::string needle;
  };
  const std::string k3 = R"("model.layers.3.self_attn.k_scale")";
  for (const Case& c : {
           Case{"{", "s.json: invalid JSON"},
           Case{"[]", "expected a JSON object"},
           Case{R"({"scales": {}})", "\"format\" is missing"},
           Case{R"({"format": "e4kv-kv-scales/2", "scales": {"a": 1}})",
                "\"format\" is \"e4kv-kv-scales/2\""},
           Case{R"({"format": "e4kv-kv-scales/1"})", "\"scales\" is missing"},
           Case{R"({"format": "e4kv-kv-scales/1", "scales": []})", "\"scales\" must be an object"},
           Case{with_scales(""), "\"scales\" is empty"},
           Case{with_scales(k3 + ": \"0.5\""), "must be a number, got string"},
           Case{with_scales(k3 + ": null"), "must be a number, got null"},
           Case{with_scales(k3 + ": true"), "must be a number, got boolean"},
           Case{with_scales(k3 + ": 0"), "is not > 0"},
           Case{with_scales(k3 + ": -0.0"), "is not > 0"},
           Case{with_scales(k3 + ": -1"), "is not > 0"},
           Case{with_scales(k3 + ": 1e39"), "overflows fp32"},
           Case{with_scales(k3 + ": 1e-50"), "underflows fp32 to 0"},
           // Outside the range the start-up gate accepts (kv_scale_value_problem).
           Case{with_scales(k3 + ": 1e30"),
                "scale \"model.layers.3.self_attn.k_scale\" = 1.00000002e+30 is too large: "
                "every FP16 value would round to zero in E4M3"},
           Case{with_scales(k3 + ": 1.4e-45"),
                "scale \"model.layers.3.self_attn.k_scale\" = 1.40129846e-45 is too small: "
                "every nonzero FP16 value would saturate to +-448 in E4M3"},
           Case{with_scales(k3 + ": 67076096"), "is too large"},
           Case{with_scales(k3 + ": 1.3797371e-10"), "is too small"},
           Case{with_scales(k3 + ": 1e999"), "number overflow"},
           Case{with_scales(k3 + ": NaN"), "invalid JSON"},
           Case{with_scales(R"("model.layers.3.self_attn.q_scale": 1)"), "is not a K/V scale key"},
           Case{with_scales(R"("model.layers.x.self_attn.k_scale": 1)"), "is not a K/V scale key"},
           Case{with_scales(k3 + ": 1, " + k3 + ": 2"), "appears twice"},
           Case{with_scales(k3 + R"(: 1, "model.layers.3.self_attn.k_proj.k_scale": 2)"),
                "both set the scale model.layers.3.self_attn.k_scale"},
           Case{R"({"format": "e4kv-kv-scales/1", "policy": 3, "scales": {"a": 1}})",
                "\"policy\" must be a string"},
           Case{R"({"format": "e4kv-kv-scales/1", "source": "x", "scales": {"a": 1}})",
                "\"source\" must be an object"},
       }) {
    Result<ScalesFile> file = parse_scales_file(c.text, "s.json");
    ASSERT_FALSE(file.ok()) << c.text;
    EXPECT_EQ(file.message().rfind("s.json: ", 0), 0u) << file.message();
    EXPECT_TRUE(contains(file.message(), c.needle)) << c.text << "\n -> " << file.message();
    EXPECT_EQ(file.message().find('\n'), std::string::npos) << file.message();
  }
}

TEST_F(ScalesFileTest, ReadMissingFileSaysHowToMakeOne) {
  Result<ScalesFile> file = read_scales_file(dir_ / "nope.json");
  ASSERT_FALSE(file.ok());
  EXPECT_TRUE(contains(file.message(), "nope.json: scales file not found"));
  EXPECT_TRUE(contains(file.message(), "e4kv summarize"));
}

}  // namespace
}  // namespace e4kv
