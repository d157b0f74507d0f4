// `e4kv verify`, `inspect`, `generate` and `logits` over overlays, through the built program
// (E4KV_CLI_PATH): a negative-control overlay is labelled NEGATIVE CONTROL in all of them; an
// overlay without its provenance fails verify; the gate's advice for invalid scales embedded in a
// base works when followed; links inside the base do not loop or leave it.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
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
using testing_support::read_text;
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

json read_json(const fs::path& path) {
  return json::parse(read_text(path));
}

void write_json(const fs::path& path, const json& value) {
  write_text(path, value.dump(2) + "\n");
}

// Writes `shard` anew (a new file renamed over it) with the F32 scalar `key` set to `value`.
void rewrite_scale(const fs::path& shard, const std::string& key, float value) {
  Result<SafetensorsFile> file = SafetensorsFile::open(shard);
  ASSERT_TRUE(file.ok()) << file.message();
  bool found = false;
  std::vector<SafetensorsWriteTensor> tensors;
  for (const SafetensorsTensor& t : file->tensors()) {
    const bool hit = t.name == key;
    found = found || hit;
    tensors.push_back({t.name, t.dtype, t.shape,
                       hit ? std::as_bytes(std::span<const float>(&value, 1)) : t.bytes});
  }
  ASSERT_TRUE(found) << key;
  const fs::path temp = shard.string() + ".tmp";
  ASSERT_TRUE(write_safetensors(temp, tensors, file->metadata()).ok());
  fs::rename(temp, shard);
}

// Every tensor byte of the safetensors files directly in `dir`.
uint64_t tensor_bytes(const fs::path& dir) {
  uint64_t total = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".safetensors") continue;
    Result<SafetensorsFile> file = SafetensorsFile::open(entry.path());
    EXPECT_TRUE(file.ok()) << file.message();
    if (!file.ok()) continue;
    for (const SafetensorsTensor& t : file->tensors()) total += t.bytes.size();
  }
  return total;
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
  // A fresh overlay of `base` with scales() that verifies; the test then tampers with its own
  // files (never the base's).
  fs::path verified_overlay(const fs::path& base, const std::string& name) {
    const fs::path out = tmp_.path() / name;
    RunResult made =
        run({"overlay", base.string(), "--scales", scales().string(), "--out", out.string()});
    EXPECT_EQ(made.exit_code, 0) << made.err;
    RunResult ok = run({"verify", out.string()});
    EXPECT_EQ(ok.exit_code, 0) << ok.err;
    return out;
  }
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

// The provenance's "scales" must be the scales the shard holds: a change to one value (even one
// ulp), a key left out or added, or no "scales" at all fails, naming the files and the key.
TEST_F(VerifyCli, ProvenanceScalesMustEqualTheScalesShard) {
  const fs::path base = make_model("base");
  const std::string k0 = "model.layers.0.self_attn.k_scale";
  const std::string v1 = "model.layers.1.self_attn.v_scale";
  struct Case {
    std::string what;
    std::function<void(json&)> edit;
    std::string needle;
  };
  const std::string disagree =
      "kvscales-provenance.json \"scales\" and model-kvscales.safetensors disagree: ";
  const Case cases[] = {
      {"another value", [&](json& p) { p["scales"][k0] = 0.5; },
       disagree + k0 +
           " = 0.5 in kvscales-provenance.json, 0.015625 in model-kvscales.safetensors"},
      {"one ulp", [&](json& p) { p["scales"][k0] = double(std::nextafter(0.015625f, 1.0f)); },
       disagree + k0 + " = 0.0156250019 in kvscales-provenance.json, 0.015625 in"},
      {"a key left out", [&](json& p) { p["scales"].erase(v1); },
       disagree + v1 + " is in model-kvscales.safetensors but not recorded"},
      {"a key added", [&](json& p) { p["scales"]["model.layers.2.self_attn.k_scale"] = 1.0; },
       disagree + "model.layers.2.self_attn.k_scale = 1 is recorded but not in "
                  "model-kvscales.safetensors"},
      {"no scales", [&](json& p) { p.erase("scales"); },
       "kvscales-provenance.json: \"scales\" is missing or not an object"},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const fs::path out = verified_overlay(base, cat("d", n++));
    json provenance = read_json(out / "kvscales-provenance.json");
    c.edit(provenance);
    write_json(out / "kvscales-provenance.json", provenance);
    expect_one_line_error(run({"verify", out.string()}), c.needle);
  }
}

// Everything in the derived index besides the weight map is what the overlay writes: the base
// index's metadata with total_size grown by the four F32 scales (16 bytes), or for a single-file
// base {"total_size": every tensor's bytes}. A changed, added or removed field fails.
TEST_F(VerifyCli, IndexMetadataMustBeWhatTheOverlayWrites) {
  for (const bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "sharded base" : "single-file base");
    const std::string tag = sharded ? "sharded" : "single";
    const fs::path base =
        make_model(cat("base-", tag), sharded ? std::vector<std::string>{"--shards", "2"}
                                              : std::vector<std::string>{});
    const uint64_t expected_total = tensor_bytes(base) + 16;
    if (sharded) {
      EXPECT_EQ(read_json(base / "model.safetensors.index.json")["metadata"]["total_size"]
                        .get<uint64_t>() +
                    16,
                expected_total);
    }
    struct Case {
      std::string what;
      std::function<void(json&)> edit;
      std::string needle;
    };
    const std::string differs =
        "model.safetensors.index.json differs from the index the overlay writes: ";
    const Case cases[] = {
        {"total_size",
         [](json& index) {
           index["metadata"]["total_size"] = index["metadata"]["total_size"].get<uint64_t>() + 4;
         },
         cat(differs, "metadata.total_size is ", expected_total + 4, ", the overlay writes ",
             expected_total)},
        {"a metadata key added",
         [](json& index) { index["metadata"]["e4kv_scales"] = "calibrated"; },
         differs + "metadata.e4kv_scales is \"calibrated\", the overlay writes absent"},
        {"total_size removed", [](json& index) { index["metadata"].erase("total_size"); },
         cat(differs, "metadata.total_size is absent, the overlay writes ", expected_total)},
        {"metadata removed", [](json& index) { index.erase("metadata"); },
         differs + "metadata is absent, the overlay writes an object"},
        {"a field added", [](json& index) { index["note"] = 1; },
         differs + "note is 1, the overlay writes absent"},
    };
    int n = 0;
    for (const Case& c : cases) {
      SCOPED_TRACE(c.what);
      const fs::path out = verified_overlay(base, cat(tag, "-", n++));
      json index = read_json(out / "model.safetensors.index.json");
      EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), expected_total);
      c.edit(index);
      write_json(out / "model.safetensors.index.json", index);
      expect_one_line_error(run({"verify", out.string()}), c.needle);
    }
  }
}

// A scales shard rewritten with other (valid) scales, its recorded digest and size patched to
// match: the start-up gate accepts it and the digest matches, but the provenance's scales do not.
// A provenance that records no digest for the shard fails too.
TEST_F(VerifyCli, ScalesShardRewrittenWithItsDigestPatchedFails) {
  const fs::path base = make_model("base");
  const fs::path out = verified_overlay(base, "d");
  const fs::path shard = out / "model-kvscales.safetensors";
  rewrite_scale(shard, "model.layers.1.self_attn.k_scale", 0.25f);
  json provenance = read_json(out / "kvscales-provenance.json");
  provenance["derived"]["scales_shard"]["sha256"] = *sha256_file(shard);
  provenance["derived"]["scales_shard"]["bytes"] = fs::file_size(shard);
  write_json(out / "kvscales-provenance.json", provenance);
  RunResult gate = run({"inspect", out.string()});
  ASSERT_EQ(gate.exit_code, 0) << gate.err;
  EXPECT_TRUE(contains(gate.out, "fp8 start-up  ok")) << gate.out;
  expect_one_line_error(run({"verify", out.string()}),
                        "kvscales-provenance.json \"scales\" and model-kvscales.safetensors "
                        "disagree: model.layers.1.self_attn.k_scale = 0.03125 in "
                        "kvscales-provenance.json, 0.25 in model-kvscales.safetensors");

  const fs::path plain = verified_overlay(base, "no-digest");
  json recorded = read_json(plain / "kvscales-provenance.json");
  recorded["derived"]["scales_shard"].erase("sha256");
  write_json(plain / "kvscales-provenance.json", recorded);
  expect_one_line_error(run({"verify", plain.string()}),
                        "kvscales-provenance.json records no sha256 for "
                        "model-kvscales.safetensors");
}

// The scales file the overlay was made from is outside the overlay: its recorded digest is
// recomputed and reported, and a changed or removed file is a note, not a failure.
TEST_F(VerifyCli, TheScalesFileDigestIsRecomputedAndReported) {
  const fs::path base = make_model("base");
  const fs::path out = verified_overlay(base, "d");
  const std::string path = fs::absolute(scales()).lexically_normal().string();
  RunResult same = run({"verify", out.string()});
  ASSERT_EQ(same.exit_code, 0) << same.err;
  EXPECT_TRUE(contains(same.out, cat("the scales file ", path, " is unchanged"))) << same.out;
  write_text(scales(), std::string(kScalesJson) + " ");
  RunResult changed = run({"verify", out.string()});
  ASSERT_EQ(changed.exit_code, 0) << changed.err;
  EXPECT_TRUE(
      contains(changed.out, cat("the scales file ", path, " changed since the overlay was made")))
      << changed.out;
  fs::remove(scales());
  RunResult gone = run({"verify", out.string()});
  ASSERT_EQ(gone.exit_code, 0) << gone.err;
  EXPECT_TRUE(contains(gone.out, cat("the scales file ", path, " is gone"))) << gone.out;
}

// Scales at which every FP16 value would be stored as 0 or as +-448 are refused by overlay (from
// scales.json), by the start-up gate (embedded in a checkpoint) and so by verify, naming the key
// and the value.
TEST_F(VerifyCli, AbsurdScalesAreRefused) {
  const fs::path base = make_model("base");
  const std::string k0 = "model.layers.0.self_attn.k_scale";
  struct Case {
    const char* text;
    std::string needle;
  };
  const Case cases[] = {
      {"1e30",
       cat("scale \"", k0,
           "\" = 1.00000002e+30 is too large: every FP16 value would round to zero in E4M3")},
      {"1.4e-45", cat("scale \"", k0,
                      "\" = 1.40129846e-45 is too small: every nonzero FP16 value would saturate "
                      "to +-448 in E4M3")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    std::string text = kScalesJson;
    const std::string from = "\"model.layers.0.self_attn.k_scale\": 0.015625";
    text.replace(text.find(from), from.size(), cat("\"", k0, "\": ", c.text));
    const fs::path path = tmp_.path() / cat("absurd-", c.text, ".json");
    write_text(path, text);
    const fs::path out = tmp_.path() / cat("absurd-", c.text);
    RunResult r = run({"overlay", base.string(), "--scales", path.string(), "--out", out.string()});
    expect_one_line_error(r, c.needle);
    EXPECT_TRUE(contains(r.err, "valid scales lie strictly between 1.37973716e-10 and 67076096"))
        << r.err;
    EXPECT_FALSE(fs::exists(out));
  }

  // Embedded in a checkpoint: engine start-up refuses it, naming the key and the value.
  const fs::path embedded = make_model("embedded", {"--with-kv-scales"});
  rewrite_scale(embedded / "model.safetensors", "model.layers.1.self_attn.v_scale", 1e30f);
  RunResult refused = run({"generate", embedded.string(), "--prompt-ids", "1,2", "--max-tokens",
                           "2", "--kv-cache-dtype", "fp8_e4m3"});
  EXPECT_EQ(refused.exit_code, 1) << refused.err;
  EXPECT_TRUE(contains(refused.err,
                       "invalid: model.layers.1.self_attn.v_scale = 1.00000002e+30 (too large: "
                       "every FP16 value would round to zero in E4M3"))
      << refused.err;

  // In an overlay's shard, with the provenance patched to agree: verify runs the gate first.
  const fs::path out = verified_overlay(base, "tiny");
  const float tiny = std::numeric_limits<float>::denorm_min();
  rewrite_scale(out / "model-kvscales.safetensors", k0, tiny);
  json provenance = read_json(out / "kvscales-provenance.json");
  provenance["scales"][k0] = double(tiny);
  provenance["derived"]["scales_shard"]["sha256"] =
      *sha256_file(out / "model-kvscales.safetensors");
  write_json(out / "kvscales-provenance.json", provenance);
  RunResult v = run({"verify", out.string()});
  EXPECT_EQ(v.exit_code, 1) << v.err;
  EXPECT_TRUE(contains(v.err, cat("invalid: ", k0,
                                  " = 1.40129846e-45 (too small: every nonzero FP16 value would "
                                  "saturate")))
      << v.err;
}

}  // namespace
}  // namespace e4kv
