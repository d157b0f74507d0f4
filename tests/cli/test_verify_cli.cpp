// `e4kv verify`, `inspect`, `generate` and `logits` over overlays, through the built program
// (E4KV_CLI_PATH): a negative-control overlay is labelled NEGATIVE CONTROL in all of them; an
// overlay without its provenance fails verify; the gate's advice for invalid scales embedded in a
// base works when followed; links inside the base do not loop or leave it.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/sha256.h"
#include "core/status.h"
#include "io/safetensors.h"
#include "testing/cli.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing_support::expect_one_line_error;
using testing_support::run_cli;
using testing_support::RunResult;
using testing_support::TempDir;
using testing_support::write_text;

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

// Scales for the default synthetic family with --layers 2 (attention on both layers).
const char* kScalesJson = R"({"format": "e4kv-kv-scales/1", "policy": "absmax",
  "scales": {"model.layers.0.self_attn.k_scale": 0.015625,
             "model.layers.0.self_attn.v_scale": 0.0078125,
             "model.layers.1.self_attn.k_scale": 0.03125,
             "model.layers.1.self_attn.v_scale": 0.0625},
  "source": {}})";

// SHA-256 of every regular file below `root` (links not followed), by relative path.
std::map<std::string, std::string> digests(const fs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    if (entry.is_symlink() || !entry.is_regular_file()) continue;
    out[fs::relative(entry.path(), root).string()] = *sha256_file(entry.path());
  }
  return out;
}

class VerifyCli : public ::testing::Test {
 protected:
  fs::path make_model(const std::string& name, const std::vector<std::string>& extra = {}) {
    const fs::path dir = tmp_.path() / name;
    std::vector<std::string> args = {"synth-checkpoint", dir.string(), "--layers", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    RunResult r = run_cli(tmp_.path(), args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return dir;
  }
  fs::path scales() {
    const fs::path path = tmp_.path() / "scales.json";
    if (!fs::exists(path)) write_text(path, kScalesJson);
    return path;
  }
  RunResult run(const std::vector<std::string>& args) { return run_cli(tmp_.path(), args); }
  TempDir tmp_;
};

TEST_F(VerifyCli, NegativeControlIsLabelledInVerifyInspectAndStartUp) {
  const fs::path base = make_model("base");
  const fs::path unit = tmp_.path() / "unit";
  const fs::path calibrated = tmp_.path() / "calibrated";
  ASSERT_EQ(run({"overlay", base.string(), "--unit-scale-negative-control", "--out", unit.string()})
                .exit_code,
            0);
  ASSERT_EQ(
      run({"overlay", base.string(), "--scales", scales().string(), "--out", calibrated.string()})
          .exit_code,
      0);

  // verify
  RunResult v = run({"verify", unit.string()});
  ASSERT_EQ(v.exit_code, 0) << v.err;
  EXPECT_TRUE(contains(v.out, "ok (NEGATIVE CONTROL: unit scales, not calibrated)")) << v.out;
  EXPECT_TRUE(contains(v.out, "kv scales: NEGATIVE CONTROL: 4/4")) << v.out;
  EXPECT_FALSE(contains(v.out, "(calibrated, 1 .. 1)")) << v.out;
  RunResult vc = run({"verify", calibrated.string()});
  ASSERT_EQ(vc.exit_code, 0) << vc.err;
  EXPECT_FALSE(contains(vc.out, "NEGATIVE CONTROL")) << vc.out;
  EXPECT_TRUE(contains(vc.out, "(calibrated, 0.0078125 .. 0.0625)")) << vc.out;

  // inspect, text and JSON
  RunResult i = run({"inspect", unit.string()});
  ASSERT_EQ(i.exit_code, 0) << i.err;
  EXPECT_TRUE(contains(i.out, "NEGATIVE CONTROL  unit scales (1.0)")) << i.out;
  EXPECT_TRUE(contains(i.out, "fp8 start-up  ok: kv scales: NEGATIVE CONTROL")) << i.out;
  EXPECT_FALSE(contains(i.out, "(calibrated, 1 .. 1)")) << i.out;
  RunResult ij = run({"inspect", unit.string(), "--json"});
  ASSERT_EQ(ij.exit_code, 0) << ij.err;
  const json report = json::parse(ij.out);
  EXPECT_EQ(report["kv_scales"]["negative_control"], true);
  EXPECT_EQ(report["fp8_e4m3_startup"]["negative_control"], true);
  RunResult ic = run({"inspect", calibrated.string(), "--json"});
  ASSERT_EQ(ic.exit_code, 0) << ic.err;
  EXPECT_EQ(json::parse(ic.out)["kv_scales"]["negative_control"], false);
  EXPECT_EQ(json::parse(ic.out)["fp8_e4m3_startup"]["negative_control"], false);

  // the start-up line of generate and logits
  RunResult g = run({"generate", unit.string(), "--prompt-ids", "1,2,3", "--max-tokens", "2",
                     "--json", "--kv-cache-dtype", "fp8_e4m3"});
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_TRUE(contains(g.err,
                       "e4kv: kv scales: NEGATIVE CONTROL: 4/4 K/V scales are the unit "
                       "scales (1.0) of an overlay made with --unit-scale-negative-control"))
      << g.err;
  EXPECT_FALSE(contains(g.err, "(calibrated,")) << g.err;
  RunResult l =
      run({"logits", unit.string(), "--ids", "1,2,3", "--json", "--kv-cache-dtype", "fp8_e4m3"});
  ASSERT_EQ(l.exit_code, 0) << l.err;
  EXPECT_TRUE(contains(l.err, "e4kv: kv scales: NEGATIVE CONTROL")) << l.err;
  RunResult gc = run({"generate", calibrated.string(), "--prompt-ids", "1,2,3", "--max-tokens", "2",
                      "--json", "--kv-cache-dtype", "fp8_e4m3"});
  ASSERT_EQ(gc.exit_code, 0) << gc.err;
  EXPECT_FALSE(contains(gc.err, "NEGATIVE CONTROL")) << gc.err;
  EXPECT_TRUE(contains(gc.err, "kv scales: 4/4 valid")) << gc.err;
}

TEST_F(VerifyCli, AnOverlayWithoutProvenanceFails) {
  const fs::path base = make_model("base", {"--shards", "2"});
  const fs::path out = tmp_.path() / "d";
  ASSERT_EQ(run({"overlay", base.string(), "--scales", scales().string(), "--out", out.string()})
                .exit_code,
            0);
  fs::remove(out / "kvscales-provenance.json");
  {
    std::fstream shard(base / "model-00002-of-00002.safetensors",
                       std::ios::in | std::ios::out | std::ios::binary);
    shard.seekp(-1, std::ios::end);
    shard.put('\x7f');
  }
  expect_one_line_error(run({"verify", out.string()}),
                        "kvscales-provenance.json is missing, so its binding to the base cannot "
                        "be checked");
}

TEST_F(VerifyCli, TokenizerFilesAreBound) {
  const fs::path base = make_model("base");
  ASSERT_TRUE(fs::exists(base / "tokenizer_config.json"));
  const fs::path out = tmp_.path() / "d";
  ASSERT_EQ(run({"overlay", base.string(), "--scales", scales().string(), "--out", out.string(),
                 "--hash", "index-config"})
                .exit_code,
            0);
  RunResult ok = run({"verify", out.string()});
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(contains(ok.out, "tokenizer_config.json")) << ok.out;
  write_text(base / "tokenizer_config.json", "{}");
  expect_one_line_error(run({"verify", out.string()}), "base file tokenizer_config.json changed");
}

// The gate's advice for a bad scale embedded in a base, followed word for word.
TEST_F(VerifyCli, EmbeddedInvalidScaleAdviceWorks) {
  const fs::path base = make_model("base", {"--with-kv-scales"});
  {
    const fs::path shard = base / "model.safetensors";
    Result<SafetensorsFile> file = SafetensorsFile::open(shard);
    ASSERT_TRUE(file.ok()) << file.message();
    const float nan = std::nanf("");
    std::vector<SafetensorsWriteTensor> tensors;
    for (const SafetensorsTensor& t : file->tensors()) {
      tensors.push_back({t.name, t.dtype, t.shape,
                         t.name == "model.layers.1.self_attn.v_scale"
                             ? std::as_bytes(std::span<const float>(&nan, 1))
                             : t.bytes});
    }
    ASSERT_TRUE(write_safetensors(tmp_.path() / "m.tmp", tensors, file->metadata()).ok());
    fs::rename(tmp_.path() / "m.tmp", shard);
  }
  const std::map<std::string, std::string> before = digests(base);
  RunResult refused = run({"generate", base.string(), "--prompt-ids", "1,2", "--max-tokens", "2",
                           "--kv-cache-dtype", "fp8_e4m3"});
  ASSERT_EQ(refused.exit_code, 1) << refused.err;
  EXPECT_TRUE(contains(refused.err, "invalid: model.layers.1.self_attn.v_scale = nan"))
      << refused.err;
  const size_t at = refused.err.find("e4kv overlay ");
  ASSERT_NE(at, std::string::npos) << refused.err;
  const std::string command =
      refused.err.substr(at, refused.err.find('\n', at) - at);  // "e4kv overlay BASE ..."
  std::vector<std::string> args;
  std::istringstream words(command.substr(std::string("e4kv ").size()));
  for (std::string word; words >> word;)
    args.push_back(word == "scales.json" ? scales().string() : word);
  ASSERT_GE(args.size(), 2u);
  EXPECT_EQ(args[0], "overlay");
  EXPECT_NE(std::find(args.begin(), args.end(), "--replace-embedded-scales"), args.end());

  RunResult made = run(args);
  ASSERT_EQ(made.exit_code, 0) << made.err;
  EXPECT_TRUE(contains(made.out, "replaced       4 K/V scale key(s) embedded in the base"))
      << made.out;
  const fs::path derived = base.string() + "-kvscales";
  ASSERT_TRUE(fs::is_directory(derived));
  RunResult g = run({"generate", derived.string(), "--prompt-ids", "1,2", "--max-tokens", "2",
                     "--json", "--kv-cache-dtype", "fp8_e4m3"});
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_TRUE(contains(g.err, "kv scales: 4/4 valid")) << g.err;
  RunResult v = run({"verify", derived.string()});
  ASSERT_EQ(v.exit_code, 0) << v.err;
  EXPECT_TRUE(contains(v.out, "embedded in the base replaced")) << v.out;
  EXPECT_EQ(digests(base), before);
}

TEST_F(VerifyCli, LinkCyclesAndLinksOutOfTheBase) {
  const fs::path base = make_model("base");
  fs::create_directory_symlink(".", base / "loop");
  for (const char* mode : {"symlink", "hardlink", "copy"}) {
    SCOPED_TRACE(mode);
    const fs::path out = tmp_.path() / cat("loop-", mode);
    RunResult r = run({"overlay", base.string(), "--scales", scales().string(), "--out",
                       out.string(), "--link", mode});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(fs::is_symlink(out / "loop"));
    EXPECT_EQ(run({"verify", out.string()}).exit_code, 0);
  }
  fs::create_directories(tmp_.path() / "outside");
  fs::create_directory_symlink(tmp_.path() / "outside", base / "escape");
  for (const char* mode : {"hardlink", "copy"}) {
    SCOPED_TRACE(mode);
    const fs::path out = tmp_.path() / cat("escape-", mode);
    expect_one_line_error(run({"overlay", base.string(), "--scales", scales().string(), "--out",
                               out.string(), "--link", mode}),
                          "escape: a symbolic link to the directory ");
    EXPECT_FALSE(fs::exists(out));
  }
  RunResult r = run({"overlay", base.string(), "--scales", scales().string(), "--out",
                     (tmp_.path() / "escape-symlink").string(), "--link", "symlink"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

}  // namespace
}  // namespace e4kv
