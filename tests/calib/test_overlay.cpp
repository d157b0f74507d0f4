// make_overlay and verify_overlay (DESIGN.md section 7): the base tree is byte- and mtime-identical
// afterwards; the merged index, scales shard and provenance are right; the derived directory
// passes the start-up gate; every refusal leaves nothing behind; verify catches a changed base and
// a removed scale.
#include "calib/overlay.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "calib/scales_file.h"
#include "calib/verify.h"
#include "core/sha256.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "kv/scale_keys.h"
#include "testing/synth_checkpoint.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// Every entry under `root` (not following links): type, size, SHA-256 of files, mtime in ns.
std::map<std::string, std::string> snapshot(const fs::path& root) {
  std::map<std::string, std::string> entries;
  auto add = [&](const fs::path& path) {
    struct stat st {};
    EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
    std::string digest;
    if (S_ISREG(st.st_mode)) digest = *sha256_file(path);
    if (S_ISLNK(st.st_mode)) digest = fs::read_symlink(path).string();
    entries[fs::relative(path, root.parent_path()).string()] = cat(
        st.st_mode, " ", st.st_size, " ", digest, " ", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
  };
  add(root);
  for (const auto& entry : fs::recursive_directory_iterator(root)) add(entry.path());
  return entries;
}

class OverlayTest : public ::testing::Test {
 protected:
  OverlayTest() {
    static std::atomic<int> counter{0};
    const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
    // A parameterised test's name holds '/' ("Name/param"): one flat directory, not a nested one.
    std::string name = info->name();
    std::replace(name.begin(), name.end(), '/', '_');
    tmp_ = fs::temp_directory_path() / cat("e4kv_overlay_", name, "_", ::getpid(), "_", counter++);
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
  }
  ~OverlayTest() override {
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }

  // A Qwen4Exp-shaped base (KV cache on layers 3 and 7) with extra non-weight files.
  fs::path make_base(int64_t n_shards, bool with_scales = false, const std::string& name = "base") {
    const fs::path dir = tmp_ / name;
    SynthCheckpointOptions options;
    options.family = SynthFamily::kQwen4Exp;
    options.n_layers = 8;
    options.n_shards = n_shards;
    options.with_kv_scales = with_scales;
    Status written = write_synth_checkpoint(dir, options);
    EXPECT_TRUE(written.ok()) << written.message();
    write_text(dir / "tokenizer.json", "{\"model\": {}}\n");
    fs::create_directories(dir / "extra");
    write_text(dir / "extra" / "notes.txt", "not a weight\n");
    return dir;
  }

  fs::path make_scales(const std::map<std::string, float>& scales, const std::string& name = "s") {
    ScalesFile file;
    file.policy = "absmax";
    file.source_json = R"({"corpus_sha256": "abc", "tokens": 4096})";
    file.scales = scales;
    const fs::path path = tmp_ / (name + ".json");
    Status written = write_scales_file(path, file);
    EXPECT_TRUE(written.ok()) << written.message();
    return path;
  }

  static std::map<std::string, float> good_scales() {
    return {{"model.layers.3.self_attn.k_scale", 0.0171247218f},
            {"model.layers.3.self_attn.v_scale", 0.0841238871f},
            {"model.layers.7.self_attn.k_scale", 1.0f},
            {"model.layers.7.self_attn.v_scale", 0.03125f}};
  }

  OverlayOptions options(const fs::path& base, const fs::path& scales, const fs::path& out) {
    OverlayOptions o;
    o.base_dir = base;
    o.scales_path = scales;
    o.out_dir = out;
    return o;
  }

  // Entries of tmp_ whose names mark them as overlay temporaries.
  std::vector<std::string> temp_dirs() const {
    std::vector<std::string> found;
    for (const auto& entry : fs::directory_iterator(tmp_)) {
      const std::string name = entry.path().filename().string();
      if (contains(name, ".e4kv-overlay-tmp.")) found.push_back(name);
    }
    return found;
  }

  // Runs make_overlay, expects it to fail with `needle`, and checks that nothing was created.
  void expect_refused(const OverlayOptions& o, const std::string& needle) {
    const bool out_existed = fs::exists(fs::symlink_status(o.out_dir));
    const std::map<std::string, std::string> before = snapshot(tmp_);
    Result<OverlayResult> made = make_overlay(o);
    ASSERT_FALSE(made.ok()) << needle;
    EXPECT_TRUE(contains(made.message(), needle)) << made.message();
    if (!out_existed) {
      EXPECT_FALSE(fs::exists(fs::symlink_status(o.out_dir))) << o.out_dir;
    }
    EXPECT_TRUE(temp_dirs().empty());
    EXPECT_EQ(snapshot(tmp_), before);
  }

  // expect_refused() for trees holding link loops, which snapshot() cannot walk: the refusal names
  // `needle` and nothing is left at the output or beside it.
  void expect_refused_no_snapshot(const OverlayOptions& o, const std::string& needle) {
    Result<OverlayResult> made = make_overlay(o);
    ASSERT_FALSE(made.ok()) << needle;
    EXPECT_TRUE(contains(made.message(), needle)) << made.message();
    EXPECT_EQ(made.message().find('\n'), std::string::npos) << made.message();
    EXPECT_FALSE(fs::exists(fs::symlink_status(o.out_dir))) << o.out_dir;
    EXPECT_TRUE(temp_dirs().empty());
  }

  fs::path tmp_;
};

class OverlayModes : public OverlayTest,
                     public ::testing::WithParamInterface<std::tuple<OverlayLinkMode, int64_t>> {};

TEST_P(OverlayModes, BuildsAValidDerivedCheckpointAndLeavesTheBaseAlone) {
  const auto [mode, n_shards] = GetParam();
  const fs::path base = make_base(n_shards);
  const fs::path scales = make_scales(good_scales());
  const fs::path out = tmp_ / "derived";
  const std::map<std::string, std::string> base_before = snapshot(base);

  OverlayOptions o = options(base, scales, out);
  o.link = mode;
  uint64_t last_done = 0;
  uint64_t last_total = 0;
  int calls = 0;
  o.progress = [&](const std::string&, uint64_t done, uint64_t total) {
    EXPECT_GE(done, last_done);
    last_done = done;
    last_total = total;
    ++calls;
  };
  Result<OverlayResult> made = make_overlay(o);
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_GT(calls, 0);
  EXPECT_EQ(last_done, last_total);
  EXPECT_EQ(snapshot(base), base_before);
  EXPECT_TRUE(temp_dirs().empty());
  EXPECT_EQ(made->out_dir, fs::canonical(out));
  EXPECT_EQ(made->n_scales, 4);

  // Every base entry but the index is present, linked as asked.
  Result<Checkpoint> base_ckpt = Checkpoint::open(base);
  ASSERT_TRUE(base_ckpt.ok());
  for (const auto& entry : fs::directory_iterator(base)) {
    const std::string name = entry.path().filename().string();
    const fs::path derived = out / name;
    if (name == kSafetensorsIndexName) {
      EXPECT_FALSE(fs::is_symlink(derived));
      continue;
    }
    ASSERT_TRUE(fs::exists(derived)) << name;
    switch (mode) {
      case OverlayLinkMode::kSymlink:
        ASSERT_TRUE(fs::is_symlink(derived)) << name;
        EXPECT_TRUE(fs::read_symlink(derived).is_absolute());
        EXPECT_EQ(fs::read_symlink(derived), fs::canonical(base) / name);
        break;
      case OverlayLinkMode::kHardlink:
        EXPECT_FALSE(fs::is_symlink(derived));
        if (fs::is_regular_file(derived)) {
          EXPECT_TRUE(fs::equivalent(derived, entry.path())) << name;
        }
        break;
      case OverlayLinkMode::kCopy:
        EXPECT_FALSE(fs::is_symlink(derived));
        if (fs::is_regular_file(derived)) {
          EXPECT_FALSE(fs::equivalent(derived, entry.path())) << name;
          EXPECT_EQ(read_text(derived), read_text(entry.path())) << name;
        }
        break;
    }
  }
  EXPECT_EQ(read_text(out / "extra" / "notes.txt"), "not a weight\n");

  // The merged index maps every base tensor where the base keeps it, and every scale key.
  const Json index = Json::parse(read_text(out / kSafetensorsIndexName));
  const Json& weight_map = index["weight_map"];
  const std::vector<std::string> base_names = base_ckpt->tensor_names();
  EXPECT_EQ(weight_map.size(), base_names.size() + 4);
  for (const std::string& name : base_names) {
    ASSERT_TRUE(weight_map.contains(name)) << name;
    EXPECT_EQ(weight_map[name], base_ckpt->shard_of(name)) << name;
  }
  for (const auto& [key, value] : good_scales()) {
    EXPECT_EQ(weight_map[key], std::string(kKvScalesShardName)) << key;
  }
  uint64_t bytes = 16;
  for (const std::string& name : base_names) bytes += base_ckpt->find(name)->bytes.size();
  EXPECT_EQ(index["metadata"]["total_size"], bytes);

  // The scales shard: F32 scalars, contract and base revision.
  const std::string revision_file =
      n_shards > 1 ? std::string(kSafetensorsIndexName) : std::string(kSingleSafetensorsName);
  const std::string revision = *sha256_file(base / revision_file);
  EXPECT_EQ(made->base_revision, revision);
  Result<SafetensorsFile> shard = SafetensorsFile::open(out / kKvScalesShardName);
  ASSERT_TRUE(shard.ok()) << shard.message();
  EXPECT_EQ(shard->metadata().at("e4kv_contract"), "e4kv-kv-scales/1");
  EXPECT_EQ(shard->metadata().at("e4kv_base_revision"), revision);
  EXPECT_EQ(shard->metadata().at("format"), "pt");
  ASSERT_EQ(shard->tensors().size(), 4u);
  for (const SafetensorsTensor& t : shard->tensors()) {
    EXPECT_EQ(t.dtype, DType::kF32);
    EXPECT_TRUE(t.shape.empty());
  }

  // The derived directory opens as a checkpoint and passes the gate with the file's values.
  Result<Checkpoint> derived = Checkpoint::open(out);
  ASSERT_TRUE(derived.ok()) << derived.message();
  Result<KvScales> gate = load_kv_scales(*derived, KvCacheDtype::kE4m3);
  ASSERT_TRUE(gate.ok()) << gate.message();
  EXPECT_EQ(gate->k_scale[3], 0.0171247218f);
  EXPECT_EQ(gate->v_scale[3], 0.0841238871f);
  EXPECT_EQ(gate->k_scale[7], 1.0f);
  EXPECT_EQ(gate->v_scale[7], 0.03125f);

  // Provenance.
  const Json provenance = Json::parse(read_text(out / kProvenanceName));
  EXPECT_EQ(provenance["format"], "e4kv-kvscales-provenance/1");
  EXPECT_EQ(provenance["tool"]["version"], E4KV_VERSION);
  EXPECT_EQ(provenance["policy"], "absmax");
  EXPECT_EQ(provenance["negative_control"], false);
  EXPECT_EQ(provenance["source"]["corpus_sha256"], "abc");
  EXPECT_EQ(provenance["scales_file"]["sha256"], *sha256_file(scales));
  EXPECT_EQ(provenance["link_mode"], std::string(overlay_link_mode_name(mode)));
  EXPECT_EQ(provenance["base"]["revision"], revision);
  EXPECT_EQ(provenance["base"]["dir"], fs::canonical(base).string());
  size_t n_files = 0;
  for (const Json& file : provenance["base"]["files"]) {
    const std::string name = file["file"];
    EXPECT_EQ(file["sha256"], *sha256_file(base / name)) << name;
    ++n_files;
  }
  // The revision file, config.json, tokenizer.json (make_base writes one) and every shard.
  EXPECT_EQ(n_files, n_shards > 1 ? 3 + static_cast<size_t>(n_shards) : 3u);
  EXPECT_TRUE(provenance["created_utc"].get<std::string>().ends_with("Z"));

  // And verify agrees.
  VerifyOptions v;
  v.dir = out;
  Result<VerifyResult> verified = verify_overlay(v);
  ASSERT_TRUE(verified.ok()) << verified.message();
  EXPECT_TRUE(verified->provenance_checked);
  EXPECT_EQ(verified->base_revision, revision);
  EXPECT_EQ(snapshot(base), base_before);
}

INSTANTIATE_TEST_SUITE_P(LinkModes, OverlayModes,
                         ::testing::Combine(::testing::Values(OverlayLinkMode::kSymlink,
                                                              OverlayLinkMode::kHardlink,
                                                              OverlayLinkMode::kCopy),
                                            ::testing::Values(int64_t{1}, int64_t{3})),
                         [](const auto& param_info) {
                           return cat(overlay_link_mode_name(std::get<0>(param_info.param)),
                                      std::get<1>(param_info.param) > 1 ? "_sharded" : "_single");
                         });

TEST_F(OverlayTest, SymlinkedBaseFilesAreResolvedForHardlinkAndCopy) {
  // A Hugging Face cache snapshot: the files are relative symbolic links into blobs/.
  const fs::path real = make_base(2, false, "real");
  const fs::path snapshot_dir = tmp_ / "hub" / "snapshots" / "rev";
  fs::create_directories(snapshot_dir);
  fs::create_directories(tmp_ / "hub" / "blobs");
  for (const auto& entry : fs::directory_iterator(real)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    fs::rename(entry.path(), tmp_ / "hub" / "blobs" / name);
    fs::create_symlink(fs::path("../../blobs") / name, snapshot_dir / name);
  }
  const fs::path scales = make_scales(good_scales());
  for (OverlayLinkMode mode :
       {OverlayLinkMode::kSymlink, OverlayLinkMode::kHardlink, OverlayLinkMode::kCopy}) {
    const fs::path out = tmp_ / cat("derived_", overlay_link_mode_name(mode));
    OverlayOptions o = options(snapshot_dir, scales, out);
    o.link = mode;
    Result<OverlayResult> made = make_overlay(o);
    ASSERT_TRUE(made.ok()) << made.message();
    Result<Checkpoint> derived = Checkpoint::open(out);
    ASSERT_TRUE(derived.ok()) << derived.message();
    EXPECT_TRUE(load_kv_scales(*derived, KvCacheDtype::kE4m3).ok());
    VerifyOptions v;
    v.dir = out;
    EXPECT_TRUE(verify_overlay(v).ok());
  }
}

TEST_F(OverlayTest, UnitScaleNegativeControl) {
  const fs::path base = make_base(1);
  const fs::path out = tmp_ / "unit";
  OverlayOptions o = options(base, "", out);
  o.unit_scale_negative_control = true;
  Result<OverlayResult> made = make_overlay(o);
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_EQ(made->policy, "unit-scale-negative-control");
  // Explicitly loaded 1.0 passes the calibrated gate: 1.0 is a legal value.
  EXPECT_EQ(made->scales.loaded, 4);
  EXPECT_EQ(made->scales.k_scale[3], 1.0f);
  const Json provenance = Json::parse(read_text(out / kProvenanceName));
  EXPECT_EQ(provenance["negative_control"], true);
  EXPECT_EQ(provenance["policy"], "unit-scale-negative-control");
  EXPECT_TRUE(provenance["scales_file"].is_null());
  EXPECT_EQ(provenance["source"]["negative_control"], true);
  for (const auto& [key, value] : provenance["scales"].items()) EXPECT_EQ(value, 1.0) << key;

  // The scales shard carries the marker, and every reader of the gate labels the scales as a
  // negative control, never "(calibrated, 1 .. 1)".
  Result<SafetensorsFile> shard = SafetensorsFile::open(out / kKvScalesShardName);
  ASSERT_TRUE(shard.ok()) << shard.message();
  EXPECT_EQ(shard->metadata().at("e4kv_negative_control"), "true");
  EXPECT_TRUE(made->scales.negative_control());
  EXPECT_TRUE(contains(made->scales.summary, "NEGATIVE CONTROL")) << made->scales.summary;
  EXPECT_FALSE(contains(made->scales.summary, "(calibrated,")) << made->scales.summary;
  VerifyOptions v;
  v.dir = out;
  Result<VerifyResult> verified = verify_overlay(v);
  ASSERT_TRUE(verified.ok()) << verified.message();
  EXPECT_TRUE(contains(verified->scales.summary, "NEGATIVE CONTROL")) << verified->scales.summary;
  bool noted = false;
  for (const std::string& note : verified->notes) noted |= contains(note, "NEGATIVE CONTROL");
  EXPECT_TRUE(noted);

  // A calibrated overlay that happens to hold 1.0 is not labelled.
  std::map<std::string, float> ones = good_scales();
  for (auto& [key, value] : ones) value = 1.0f;
  Result<OverlayResult> calibrated = make_overlay(options(base, make_scales(ones), tmp_ / "ones"));
  ASSERT_TRUE(calibrated.ok()) << calibrated.message();
  EXPECT_FALSE(calibrated->scales.negative_control());
  EXPECT_TRUE(contains(calibrated->scales.summary, "(calibrated, 1 .. 1)"))
      << calibrated->scales.summary;
  Result<SafetensorsFile> calibrated_shard =
      SafetensorsFile::open(tmp_ / "ones" / kKvScalesShardName);
  ASSERT_TRUE(calibrated_shard.ok());
  EXPECT_EQ(calibrated_shard->metadata().at("e4kv_negative_control"), "false");

  // The marker and the provenance must agree: a provenance edited to hide it fails verify.
  Json edited = Json::parse(read_text(out / kProvenanceName));
  edited["negative_control"] = false;
  write_text(out / kProvenanceName, edited.dump(2));
  Result<VerifyResult> hidden = verify_overlay(v);
  ASSERT_FALSE(hidden.ok());
  EXPECT_TRUE(contains(hidden.message(), "disagree on whether the scales are a negative control"))
      << hidden.message();
}

TEST_F(OverlayTest, HashScopeIndexConfig) {
  const fs::path base = make_base(3);
  OverlayOptions o = options(base, make_scales(good_scales()), tmp_ / "d");
  o.hash = OverlayHashScope::kIndexConfig;
  Result<OverlayResult> made = make_overlay(o);
  ASSERT_TRUE(made.ok()) << made.message();
  // The index, config.json and tokenizer.json are hashed; the three shards recorded by size.
  EXPECT_EQ(made->n_hashed, 3);
  EXPECT_EQ(made->n_size_only, 3);
  const Json provenance = Json::parse(read_text(tmp_ / "d" / kProvenanceName));
  EXPECT_EQ(provenance["hash_scope"], "index-config");
  ASSERT_EQ(provenance["base"]["files"].size(), 6u);
  for (const Json& file : provenance["base"]["files"]) {
    const std::string name = file["file"];
    if (file["role"] == "shard") {
      EXPECT_TRUE(file["sha256"].is_null()) << name;
      EXPECT_EQ(file["check"], "size") << name;
      EXPECT_EQ(file["bytes"], fs::file_size(base / name)) << name;
    } else {
      EXPECT_EQ(file["sha256"], *sha256_file(base / name)) << name;
      EXPECT_EQ(file["check"], "sha256") << name;
    }
  }
  VerifyOptions v;
  v.dir = tmp_ / "d";
  Result<VerifyResult> verified = verify_overlay(v);
  ASSERT_TRUE(verified.ok()) << verified.message();
  ASSERT_EQ(verified->notes.size(), 3u);
  EXPECT_TRUE(contains(verified->notes[2], "the scales file")) << verified->notes[2];
  EXPECT_TRUE(contains(verified->notes[1], "--hash index-config")) << verified->notes[1];
  EXPECT_TRUE(contains(verified->notes[1], "checked for existence and size only, not hashed"))
      << verified->notes[1];
  EXPECT_TRUE(contains(verified->notes[1], "model-00002-of-00003.safetensors"))
      << verified->notes[1];
  EXPECT_EQ(verified->size_only_files.size(), 3u);
  EXPECT_EQ(verified->hashed_files, (std::vector<std::string>{"model.safetensors.index.json",
                                                              "config.json", "tokenizer.json"}));

  // A single-file base is always hashed: it is the revision.
  const fs::path single = make_base(1, false, "single");
  o = options(single, make_scales(good_scales()), tmp_ / "d1");
  o.hash = OverlayHashScope::kIndexConfig;
  made = make_overlay(o);
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_EQ(made->revision_file, "model.safetensors");
  EXPECT_EQ(made->base_revision, *sha256_file(single / "model.safetensors"));
}

TEST_F(OverlayTest, EmptyExistingOutputIsReplaced) {
  const fs::path base = make_base(1);
  fs::create_directories(tmp_ / "empty");
  Result<OverlayResult> made =
      make_overlay(options(base, make_scales(good_scales()), tmp_ / "empty/"));
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_TRUE(fs::exists(tmp_ / "empty" / kKvScalesShardName));
}

TEST_F(OverlayTest, RefusesBaseWithScaleKeys) {
  const fs::path base = make_base(2, /*with_scales=*/true);
  expect_refused(options(base, make_scales(good_scales()), tmp_ / "d"),
                 "the base already holds 4 K/V scale key(s): model.layers.3.self_attn.k_scale (in "
                 "model-0000");
}

TEST_F(OverlayTest, RefusesBaseWithAnAliasScaleKey) {
  const fs::path base = make_base(1);
  // Rewrite model.safetensors with one extra alias-spelled scale.
  {
    Result<SafetensorsFile> file = SafetensorsFile::open(base / "model.safetensors");
    ASSERT_TRUE(file.ok());
    std::vector<SafetensorsWriteTensor> tensors;
    for (const SafetensorsTensor& t : file->tensors()) {
      tensors.push_back({t.name, t.dtype, t.shape, t.bytes});
    }
    const float one = 1.0f;
    tensors.push_back({"model.layers.7.self_attn.qkv_proj.v_scale",
                       DType::kF32,
                       {},
                       std::as_bytes(std::span<const float>(&one, 1))});
    ASSERT_TRUE(write_safetensors(tmp_ / "rewritten.safetensors", tensors, {}).ok());
  }
  fs::rename(tmp_ / "rewritten.safetensors", base / "model.safetensors");
  expect_refused(options(base, make_scales(good_scales()), tmp_ / "d"),
                 "model.layers.7.self_attn.qkv_proj.v_scale (in model.safetensors)");
}

TEST_F(OverlayTest, RefusesAnOverlayAsBase) {
  const fs::path base = make_base(1);
  const fs::path scales = make_scales(good_scales());
  ASSERT_TRUE(make_overlay(options(base, scales, tmp_ / "d")).ok());
  expect_refused(options(tmp_ / "d", scales, tmp_ / "d2"), "kvscales.safetensors");
}

TEST_F(OverlayTest, RefusesBadOutputs) {
  const fs::path base = make_base(1);
  const fs::path scales = make_scales(good_scales());
  expect_refused(options(base, scales, base), "is the base directory");
  expect_refused(options(base, scales, tmp_ / "base" / "." / ""), "is the base directory");
  expect_refused(options(base, scales, base / "sub"), "lies inside the base directory");
  expect_refused(options(base, scales, base / "extra"), "lies inside the base directory");
  expect_refused(options(base, scales, tmp_), "contains the base directory");
  fs::create_directories(tmp_ / "full");
  write_text(tmp_ / "full" / "x", "x");
  expect_refused(options(base, scales, tmp_ / "full"), "exists and is not empty");
  write_text(tmp_ / "file", "x");
  expect_refused(options(base, scales, tmp_ / "file"), "exists and is not a directory");
  expect_refused(options(base, scales, tmp_ / "no" / "such" / "d"),
                 "parent directory " + (tmp_ / "no" / "such").string() + " does not exist");
  fs::create_directory_symlink(tmp_ / "elsewhere", tmp_ / "link");
  expect_refused(options(base, scales, tmp_ / "link"), "is a symbolic link");
  // The output reached through a symbolic link to the base's parent is still inside the base.
  fs::create_directory_symlink(base, tmp_ / "base_link");
  expect_refused(options(base, scales, tmp_ / "base_link" / "d"), "lies inside the base directory");
}

TEST_F(OverlayTest, RefusesBadScales) {
  const fs::path base = make_base(3);
  const fs::path out = tmp_ / "d";
  std::map<std::string, float> incomplete = good_scales();
  incomplete.erase("model.layers.7.self_attn.v_scale");
  expect_refused(options(base, make_scales(incomplete, "incomplete"), out),
                 "KV scale gate: loaded 3/4 K/V scales for kv-cache-dtype fp8_e4m3 from ");
  expect_refused(options(base, make_scales(incomplete, "incomplete"), out),
                 "\n  missing: model.layers.7.self_attn.v_scale");

  std::map<std::string, float> stray = good_scales();
  stray["model.layers.2.self_attn.k_scale"] = 0.5f;
  expect_refused(options(base, make_scales(stray, "stray"), out),
                 "unexpected: model.layers.2.self_attn.k_scale (layer 2 is linear_attention");

  std::map<std::string, float> other_prefix;
  for (const auto& [key, value] : good_scales())
    other_prefix["model.language_model." + key.substr(6)] = value;
  expect_refused(options(base, make_scales(other_prefix, "other"), out), "loaded 0/4");

  write_text(
      tmp_ / "bad.json",
      R"({"format": "e4kv-kv-scales/1", "scales": {"model.layers.3.self_attn.k_scale": 0}})");
  expect_refused(options(base, tmp_ / "bad.json", out),
                 "bad.json: scale \"model.layers.3.self_attn.k_scale\"");
  expect_refused(options(base, tmp_ / "missing.json", out), "missing.json: not found");
  expect_refused(options(base, tmp_, out), "is a directory, expected a regular file");

  OverlayOptions both = options(base, make_scales(good_scales()), out);
  both.unit_scale_negative_control = true;
  expect_refused(both, "not both");
  expect_refused(options(base, "", out), "scales_path: is required");
  EXPECT_EQ(make_overlay(options(base, "", out)).status().option(), "scales_path");
}

TEST_F(OverlayTest, RefusesBadBases) {
  const fs::path scales = make_scales(good_scales());
  expect_refused(options(tmp_ / "nothing", scales, tmp_ / "d"),
                 "base checkpoint directory not found");
  write_text(tmp_ / "plain", "x");
  expect_refused(options(tmp_ / "plain", scales, tmp_ / "d"), "the base is not a directory");
  fs::create_directories(tmp_ / "no_weights");
  write_text(tmp_ / "no_weights" / "config.json", "{}");
  expect_refused(options(tmp_ / "no_weights", scales, tmp_ / "d"), "config.json");
}

TEST_F(OverlayTest, StaleTemporaryDirectoryIsRemovedByTheNextRun) {
  const fs::path base = make_base(1);
  // What a killed run leaves: a temporary directory named for a process that no longer exists.
  pid_t dead = 0;
  {
    const pid_t child = ::fork();
    if (child == 0) ::_exit(0);
    ASSERT_GT(child, 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    dead = child;
  }
  const fs::path stale = tmp_ / cat(".d.e4kv-overlay-tmp.", dead);
  fs::create_directories(stale / "partial");
  // A live process's directory is left alone (another run may be building it).
  const fs::path live = tmp_ / cat(".d.e4kv-overlay-tmp.", ::getppid());
  fs::create_directories(live);
  Result<OverlayResult> made = make_overlay(options(base, make_scales(good_scales()), tmp_ / "d"));
  ASSERT_TRUE(made.ok()) << made.message();
  ASSERT_EQ(made->removed_stale.size(), 1u);
  EXPECT_EQ(made->removed_stale[0], stale);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
}

// ---- verify -------------------------------------------------------------------------------------

class VerifyTest : public OverlayTest {
 protected:
  fs::path make_derived(OverlayLinkMode mode = OverlayLinkMode::kSymlink) {
    base_ = make_base(3);
    OverlayOptions o = options(base_, make_scales(good_scales()), tmp_ / "derived");
    o.link = mode;
    Result<OverlayResult> made = make_overlay(o);
    EXPECT_TRUE(made.ok()) << made.message();
    return tmp_ / "derived";
  }
  Result<VerifyResult> verify(const fs::path& dir) {
    VerifyOptions v;
    v.dir = dir;
    return verify_overlay(v);
  }
  // Flips the last byte of a file (inside the data section of a safetensors file, so it still
  // parses).
  static void flip_last_byte(const fs::path& path) {
    std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-1, std::ios::end);
    char c = 0;
    file.get(c);
    file.seekp(-1, std::ios::end);
    file.put(static_cast<char>(c ^ 0x5A));
  }
  fs::path base_;
};

TEST_F(VerifyTest, CatchesAChangedBaseShard) {
  const fs::path derived = make_derived();
  flip_last_byte(base_ / "model-00002-of-00003.safetensors");
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(),
                       "base file model-00002-of-00003.safetensors changed "
                       "since the overlay was made"))
      << verified.message();
  EXPECT_TRUE(contains(verified.message(), "re-create the overlay"));
  EXPECT_EQ(verified.message().find('\n'), std::string::npos);
}

TEST_F(VerifyTest, CatchesAChangedConfigAndIndex) {
  const fs::path derived = make_derived();
  write_text(base_ / "config.json", read_text(base_ / "config.json") + " ");
  write_text(base_ / kSafetensorsIndexName, read_text(base_ / kSafetensorsIndexName) + "\n");
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "base file config.json changed")) << verified.message();
  EXPECT_TRUE(contains(verified.message(), "base file model.safetensors.index.json changed"));
}

TEST_F(VerifyTest, CatchesAMissingBaseFileAndAChangedCopy) {
  const fs::path derived = make_derived(OverlayLinkMode::kCopy);
  flip_last_byte(derived / "model-00001-of-00003.safetensors");
  fs::remove(base_ / "model-00003-of-00003.safetensors");
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "base file model-00003-of-00003.safetensors is missing"))
      << verified.message();
  EXPECT_TRUE(contains(verified.message(),
                       "derived file model-00001-of-00003.safetensors no longer matches"))
      << verified.message();
}

TEST_F(VerifyTest, CatchesARemovedScaleWithTheStartUpMessage) {
  const fs::path derived = make_derived();
  // Rewrite the scales shard and the index without layer 7's V scale.
  const std::string removed = "model.layers.7.self_attn.v_scale";
  {
    Result<SafetensorsFile> shard = SafetensorsFile::open(derived / kKvScalesShardName);
    ASSERT_TRUE(shard.ok());
    std::vector<SafetensorsWriteTensor> tensors;
    for (const SafetensorsTensor& t : shard->tensors()) {
      if (t.name != removed) tensors.push_back({t.name, t.dtype, t.shape, t.bytes});
    }
    ASSERT_TRUE(write_safetensors(tmp_ / "scales.tmp", tensors, shard->metadata()).ok());
  }
  fs::rename(tmp_ / "scales.tmp", derived / kKvScalesShardName);
  Json index = Json::parse(read_text(derived / kSafetensorsIndexName));
  index["weight_map"].erase(removed);
  write_text(derived / kSafetensorsIndexName, index.dump());

  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  Result<Checkpoint> ckpt = Checkpoint::open(derived);
  ASSERT_TRUE(ckpt.ok());
  Result<KvScales> startup = load_kv_scales(*ckpt, KvCacheDtype::kE4m3);
  ASSERT_FALSE(startup.ok());
  EXPECT_EQ(verified.message(), startup.message());
  EXPECT_TRUE(contains(verified.message(), "loaded 3/4")) << verified.message();
  EXPECT_TRUE(contains(verified.message(), "missing: " + removed));
  EXPECT_TRUE(contains(verified.message(), "\n  this directory is an overlay: e4kv verify "))
      << verified.message();
}

TEST_F(VerifyTest, CatchesAReplacedScalesShard) {
  const fs::path derived = make_derived();
  {
    Result<SafetensorsFile> shard = SafetensorsFile::open(derived / kKvScalesShardName);
    ASSERT_TRUE(shard.ok());
    std::vector<float> values(shard->tensors().size(), 0.5f);
    std::vector<SafetensorsWriteTensor> tensors;
    for (size_t i = 0; i < values.size(); ++i) {
      const SafetensorsTensor& t = shard->tensors()[i];
      tensors.push_back(
          {t.name, t.dtype, t.shape, std::as_bytes(std::span<const float>(&values[i], 1))});
    }
    std::map<std::string, std::string> metadata = shard->metadata();
    metadata["e4kv_base_revision"] = std::string(64, '0');
    ASSERT_TRUE(write_safetensors(tmp_ / "scales.tmp", tensors, metadata).ok());
  }
  fs::rename(tmp_ / "scales.tmp", derived / kKvScalesShardName);
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(),
                       "model-kvscales.safetensors was made for another base "
                       "revision"))
      << verified.message();
  EXPECT_TRUE(contains(verified.message(), "model-kvscales.safetensors changed since the overlay"));
}

TEST_F(VerifyTest, CatchesAnIndexThatMovesABaseTensor) {
  const fs::path derived = make_derived(OverlayLinkMode::kCopy);
  // Point a scale key's index entry at a base shard: the checkpoint then fails to open, which is
  // what start-up would say.
  Json index = Json::parse(read_text(derived / kSafetensorsIndexName));
  index["weight_map"]["model.layers.3.self_attn.k_scale"] = "model-00001-of-00003.safetensors";
  write_text(derived / kSafetensorsIndexName, index.dump());
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "model.layers.3.self_attn.k_scale"))
      << verified.message();
}

TEST_F(VerifyTest, PlainCheckpointWithScalesPassesOnTheGateAlone) {
  const fs::path base = make_base(2, /*with_scales=*/true);
  Result<VerifyResult> verified = verify(base);
  ASSERT_TRUE(verified.ok()) << verified.message();
  EXPECT_FALSE(verified->provenance_checked);
  ASSERT_EQ(verified->notes.size(), 1u);
  EXPECT_TRUE(contains(verified->notes[0], "provenance: not checked"));

  const fs::path bare = make_base(2, false, "bare");
  Result<VerifyResult> refused = verify(bare);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.message(), "KV scale gate: loaded 0/4")) << refused.message();

  VerifyOptions fp16;
  fp16.dir = bare;
  fp16.dtype = KvCacheDtype::kF16;
  EXPECT_TRUE(verify_overlay(fp16).ok());
}

TEST_F(VerifyTest, DamagedProvenanceIsNamed) {
  const fs::path derived = make_derived();
  write_text(derived / kProvenanceName, "{\"format\": \"something-else\"}");
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(),
                       "kvscales-provenance.json: \"format\" is "
                       "\"something-else\""))
      << verified.message();
  write_text(derived / kProvenanceName, "{");
  verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "invalid JSON")) << verified.message();
}

// ---- verify: overlays without provenance, every engine file bound, the cheap hash scope -------

TEST_F(VerifyTest, AnOverlayWithoutItsProvenanceFails) {
  const fs::path derived = make_derived();
  fs::remove(derived / kProvenanceName);
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(),
                       "is an overlay (model-kvscales.safetensors records base "
                       "revision "))
      << verified.message();
  EXPECT_TRUE(contains(verified.message(), "kvscales-provenance.json is missing"));
  EXPECT_TRUE(contains(verified.message(), "re-create the overlay"));
  EXPECT_EQ(verified.message().find('\n'), std::string::npos);
  // ... and stays failed when the base changed too (the case that used to pass).
  flip_last_byte(base_ / "model-00002-of-00003.safetensors");
  EXPECT_FALSE(verify(derived).ok());

  // A scales shard without the revision metadata is still an overlay's.
  const fs::path second = tmp_ / "second";
  ASSERT_TRUE(
      make_overlay(options(make_base(1, false, "b1"), make_scales(good_scales()), second)).ok());
  {
    Result<SafetensorsFile> shard = SafetensorsFile::open(second / kKvScalesShardName);
    ASSERT_TRUE(shard.ok());
    std::vector<SafetensorsWriteTensor> tensors;
    for (const SafetensorsTensor& t : shard->tensors()) {
      tensors.push_back({t.name, t.dtype, t.shape, t.bytes});
    }
    ASSERT_TRUE(write_safetensors(tmp_ / "scales.tmp", tensors, {{"format", "pt"}}).ok());
  }
  fs::rename(tmp_ / "scales.tmp", second / kKvScalesShardName);
  fs::remove(second / kProvenanceName);
  verified = verify(second);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "is an overlay (it holds model-kvscales.safetensors)"))
      << verified.message();
}

TEST_F(VerifyTest, EveryFileTheEngineReadsIsBound) {
  base_ = make_base(3);
  const std::vector<std::string> small = {"generation_config.json", "tokenizer_config.json",
                                          "special_tokens_map.json", "chat_template.jinja"};
  for (const std::string& name : small) write_text(base_ / name, "{\"x\": 1}\n");
  for (OverlayLinkMode mode : {OverlayLinkMode::kSymlink, OverlayLinkMode::kCopy}) {
    const fs::path derived = tmp_ / cat("derived_", overlay_link_mode_name(mode));
    OverlayOptions o = options(base_, make_scales(good_scales()), derived);
    o.link = mode;
    ASSERT_TRUE(make_overlay(o).ok());
    const Json provenance = Json::parse(read_text(derived / kProvenanceName));
    std::vector<std::string> recorded;
    for (const Json& file : provenance["base"]["files"]) recorded.push_back(file["file"]);
    for (const char* name :
         {"model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
          "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
          "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
          "model-00003-of-00003.safetensors"}) {
      EXPECT_NE(std::find(recorded.begin(), recorded.end(), name), recorded.end()) << name;
    }
    ASSERT_TRUE(verify(derived).ok());
  }
  const fs::path derived = tmp_ / "derived_symlink";
  for (const std::string& name :
       {std::string("tokenizer.json"), small[0], small[1], small[2], small[3]}) {
    SCOPED_TRACE(name);
    const std::string before = read_text(base_ / name);
    write_text(base_ / name, before + " ");
    Result<VerifyResult> verified = verify(derived);
    ASSERT_FALSE(verified.ok());
    EXPECT_TRUE(contains(verified.message(), "base file " + name + " changed since the overlay"))
        << verified.message();
    write_text(base_ / name, before);
  }
  ASSERT_TRUE(verify(derived).ok());
  const std::string chat_template = read_text(base_ / "chat_template.jinja");
  fs::remove(base_ / "chat_template.jinja");
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "base file chat_template.jinja is missing"))
      << verified.message();
  write_text(base_ / "chat_template.jinja", chat_template);

  // A file the engine reads that the provenance does not bind (here: its record removed) fails.
  const fs::path copy = tmp_ / "derived_copy";
  ASSERT_TRUE(verify(copy).ok());
  const Json provenance = Json::parse(read_text(copy / kProvenanceName));
  Json edited = provenance;
  Json files = Json::array();
  for (const Json& file : provenance["base"]["files"]) {
    if (file["file"] != "special_tokens_map.json") files.push_back(file);
  }
  edited["base"]["files"] = files;
  write_text(copy / kProvenanceName, edited.dump(2));
  verified = verify(copy);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(),
                       "special_tokens_map.json is read by the engine but not "
                       "recorded in the provenance"))
      << verified.message();
}

TEST_F(VerifyTest, IndexConfigScopeFailsOnHashedChangesAndOnSizes) {
  base_ = make_base(3);
  OverlayOptions o = options(base_, make_scales(good_scales()), tmp_ / "derived");
  o.hash = OverlayHashScope::kIndexConfig;
  ASSERT_TRUE(make_overlay(o).ok());
  const fs::path derived = tmp_ / "derived";

  // A same-size change of a shard is beyond this scope, and the note says the shards were only
  // checked for size.
  flip_last_byte(base_ / "model-00001-of-00003.safetensors");
  Result<VerifyResult> verified = verify(derived);
  ASSERT_TRUE(verified.ok()) << verified.message();
  EXPECT_EQ(verified->size_only_files.size(), 3u);

  // A hashed file's change fails.
  const std::string tokenizer = read_text(base_ / "tokenizer.json");
  write_text(base_ / "tokenizer.json", tokenizer + "\n");
  verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "base file tokenizer.json changed"))
      << verified.message();
  write_text(base_ / "tokenizer.json", tokenizer);

  // A shard of another size (still a valid shard: more header metadata) fails, and so does a
  // missing one.
  {
    const fs::path shard = base_ / "model-00002-of-00003.safetensors";
    Result<SafetensorsFile> file = SafetensorsFile::open(shard);
    ASSERT_TRUE(file.ok());
    std::vector<SafetensorsWriteTensor> tensors;
    for (const SafetensorsTensor& t : file->tensors()) {
      tensors.push_back({t.name, t.dtype, t.shape, t.bytes});
    }
    ASSERT_TRUE(
        write_safetensors(tmp_ / "grown.tmp", tensors, {{"format", "pt"}, {"note", "grown"}}).ok());
    fs::rename(tmp_ / "grown.tmp", shard);
  }
  verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(),
                       "base file model-00002-of-00003.safetensors changed size since the overlay "
                       "was made"))
      << verified.message();
  // (A missing shard already stops the checkpoint from opening, with the engine's own message.)
  fs::remove(base_ / "model-00003-of-00003.safetensors");
  verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "model-00003-of-00003.safetensors"))
      << verified.message();
}

TEST_F(VerifyTest, ErrorsCarryTheRealErrno) {
  const fs::path derived = make_derived();
  // A symbolic link loop where the provenance was: not "missing", the loop.
  fs::rename(derived / kProvenanceName, tmp_ / "provenance.json");
  fs::create_symlink(kProvenanceName, derived / kProvenanceName);
  Result<VerifyResult> verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "too many levels of symbolic links"))
      << verified.message();
  fs::remove(derived / kProvenanceName);
  fs::rename(tmp_ / "provenance.json", derived / kProvenanceName);
  ASSERT_TRUE(verify(derived).ok());

  // A base file replaced by a link loop.
  fs::rename(base_ / "tokenizer.json", tmp_ / "tokenizer.json");
  fs::create_symlink("tokenizer.json", base_ / "tokenizer.json");
  verified = verify(derived);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(
      contains(verified.message(),
               "base file tokenizer.json cannot be read: too many levels of symbolic links"))
      << verified.message();
  fs::remove(base_ / "tokenizer.json");
  fs::rename(tmp_ / "tokenizer.json", base_ / "tokenizer.json");

  if (::geteuid() == 0) GTEST_SKIP() << "permission checks do not apply to root";
  fs::permissions(base_ / "config.json", fs::perms::none);
  verified = verify(derived);
  fs::permissions(base_ / "config.json", fs::perms::owner_read | fs::perms::owner_write);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "permission denied")) << verified.message();
}

TEST_F(OverlayTest, ErrorsCarryTheRealErrno) {
  const fs::path base = make_base(1);
  // A link loop among the files the engine reads.
  fs::create_symlink("generation_config.json", base / "generation_config.json");
  expect_refused_no_snapshot(options(base, make_scales(good_scales()), tmp_ / "d"),
                             "generation_config.json: cannot read: too many levels of symbolic "
                             "links");
  fs::remove(base / "generation_config.json");
  // --scales through a link loop.
  fs::create_symlink("loop.json", tmp_ / "loop.json");
  expect_refused_no_snapshot(options(base, tmp_ / "loop.json", tmp_ / "d"),
                             "loop.json: cannot open: too many levels of symbolic links");
  // The base through a link loop.
  fs::create_symlink("loop_dir", tmp_ / "loop_dir");
  expect_refused_no_snapshot(
      options(tmp_ / "loop_dir", make_scales(good_scales()), tmp_ / "d"),
      "cannot open the base checkpoint directory: too many levels of symbolic links");

  if (::geteuid() == 0) GTEST_SKIP() << "permission checks do not apply to root";
  const fs::path scales = make_scales(good_scales(), "locked");
  fs::permissions(scales, fs::perms::none);
  expect_refused_no_snapshot(options(base, scales, tmp_ / "d"),
                             "locked.json: cannot open: permission denied");
  // A base the user may not read.
  fs::permissions(base / "config.json", fs::perms::none);
  expect_refused_no_snapshot(options(base, make_scales(good_scales()), tmp_ / "d"),
                             "permission denied");
  fs::permissions(base / "config.json", fs::perms::owner_read | fs::perms::owner_write);
  fs::permissions(scales, fs::perms::owner_read | fs::perms::owner_write);
}

// ---- links inside the base: cycles and links out of the base, in every link mode --------------

class OverlayLinks : public OverlayTest, public ::testing::WithParamInterface<OverlayLinkMode> {};

TEST_P(OverlayLinks, DirectoryLinkCyclesAreNotFollowed) {
  const OverlayLinkMode mode = GetParam();
  const fs::path base = make_base(2);
  // A link to the base itself at the top, and one back up the tree from a subfolder.
  fs::create_directory_symlink(".", base / "loop");
  fs::create_directory_symlink("..", base / "extra" / "up");
  const std::map<std::string, std::string> before = snapshot(base);
  OverlayOptions o = options(base, make_scales(good_scales()), tmp_ / "d");
  o.link = mode;
  Result<OverlayResult> made = make_overlay(o);
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_EQ(snapshot(base), before);
  const fs::path out = tmp_ / "d";
  ASSERT_TRUE(fs::is_symlink(out / "loop"));
  if (mode == OverlayLinkMode::kSymlink) {
    EXPECT_EQ(fs::read_symlink(out / "loop"), fs::canonical(base) / "loop");
  } else {
    // Recreated as a link to the same place in the derived tree, not descended.
    EXPECT_EQ(fs::read_symlink(out / "loop"), fs::path("."));
    ASSERT_TRUE(fs::is_symlink(out / "extra" / "up"));
    EXPECT_EQ(fs::read_symlink(out / "extra" / "up"), fs::path(".."));
    EXPECT_EQ(fs::canonical(out / "extra" / "up"), fs::canonical(out));
  }
  // Nothing was written through the cycle: the derived tree (links not followed) is small.
  size_t entries = 0;
  for (auto it = fs::recursive_directory_iterator(out); it != fs::recursive_directory_iterator();
       ++it) {
    ++entries;
  }
  EXPECT_LT(entries, 20u);
  VerifyOptions v;
  v.dir = out;
  EXPECT_TRUE(verify_overlay(v).ok());
}

TEST_P(OverlayLinks, DirectoryLinksOutOfTheBaseAreRefusedOrLinked) {
  const OverlayLinkMode mode = GetParam();
  const fs::path base = make_base(1);
  fs::create_directories(tmp_ / "outside");
  write_text(tmp_ / "outside" / "big.bin", std::string(4096, 'x'));
  fs::create_directory_symlink("../../outside", base / "extra" / "escape");
  OverlayOptions o = options(base, make_scales(good_scales()), tmp_ / "d");
  o.link = mode;
  if (mode == OverlayLinkMode::kSymlink) {
    // Only the top-level entry is linked; nothing below it is walked or copied.
    Result<OverlayResult> made = make_overlay(o);
    ASSERT_TRUE(made.ok()) << made.message();
    EXPECT_EQ(fs::read_symlink(tmp_ / "d" / "extra"), fs::canonical(base) / "extra");
    return;
  }
  expect_refused(o, cat((fs::canonical(base) / "extra" / "escape").string(),
                        ": a symbolic link to the directory ",
                        fs::canonical(tmp_ / "outside").string(), ", outside the base"));
  expect_refused(o, cat("the ", overlay_link_mode_name(mode),
                        " link mode never follows a directory link out of the base"));
  EXPECT_EQ(make_overlay(o).status().option(), "link");
}

TEST_P(OverlayLinks, FileLinkLoopsAreRefusedWithTheirErrno) {
  const OverlayLinkMode mode = GetParam();
  const fs::path base = make_base(1);
  fs::create_symlink("self", base / "extra" / "self");
  OverlayOptions o = options(base, make_scales(good_scales()), tmp_ / "d");
  o.link = mode;
  if (mode == OverlayLinkMode::kSymlink) {
    ASSERT_TRUE(make_overlay(o).ok());  // the base's own entry is linked, never followed
    return;
  }
  expect_refused_no_snapshot(o,
                             "self: a symbolic link that cannot be followed: too many levels of "
                             "symbolic links");
}

INSTANTIATE_TEST_SUITE_P(LinkModes, OverlayLinks,
                         ::testing::Values(OverlayLinkMode::kSymlink, OverlayLinkMode::kHardlink,
                                           OverlayLinkMode::kCopy),
                         [](const auto& param_info) {
                           return std::string(overlay_link_mode_name(param_info.param));
                         });

// ---- scales embedded in the base: the gate's advice, and --replace-embedded-scales ------------

// Rewrites `shard` with `key` set to `value` (F32 scalar).
void set_scale(const fs::path& shard, const std::string& key, float value) {
  Result<SafetensorsFile> file = SafetensorsFile::open(shard);
  ASSERT_TRUE(file.ok()) << file.message();
  std::vector<SafetensorsWriteTensor> tensors;
  for (const SafetensorsTensor& t : file->tensors()) {
    if (t.name == key) {
      tensors.push_back(
          {t.name, t.dtype, t.shape, std::as_bytes(std::span<const float>(&value, 1))});
    } else {
      tensors.push_back({t.name, t.dtype, t.shape, t.bytes});
    }
  }
  const fs::path temp = shard.parent_path().parent_path() / "rewrite.tmp";
  ASSERT_TRUE(write_safetensors(temp, tensors, file->metadata()).ok());
  fs::rename(temp, shard);
}

TEST_F(VerifyTest, EmbeddedInvalidScalesGetAdviceThatWorks) {
  const fs::path base = make_base(2, /*with_scales=*/true);
  Result<Checkpoint> ckpt = Checkpoint::open(base);
  ASSERT_TRUE(ckpt.ok());
  const std::string key = "model.layers.7.self_attn.v_scale";
  const fs::path shard = base / ckpt->shard_of(key);
  set_scale(shard, key, 0.0f);
  ckpt = Checkpoint::open(base);
  ASSERT_TRUE(ckpt.ok());
  Result<KvScales> refused = load_kv_scales(*ckpt, KvCacheDtype::kE4m3);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.message(), "invalid: " + key + " = 0")) << refused.message();
  EXPECT_TRUE(contains(
      refused.message(),
      cat("embedded in this checkpoint's own shards; replace them without writing "
          "into it: e4kv summarize STATS... --out scales.json --report report && e4kv overlay ",
          base.string(), " --scales scales.json --replace-embedded-scales --out ", base.string(),
          "-kvscales")))
      << refused.message();

  // What the advice says, done: a plain overlay refuses (naming the option), the option works.
  const fs::path scales = make_scales(good_scales());
  expect_refused(options(base, scales, tmp_ / "d"),
                 "to replace them with your scales, set this option");
  EXPECT_EQ(make_overlay(options(base, scales, tmp_ / "d")).status().option(),
            "replace_embedded_scales");
  const std::map<std::string, std::string> before = snapshot(base);
  OverlayOptions o = options(base, scales, tmp_ / "d");
  o.replace_embedded_scales = true;
  Result<OverlayResult> made = make_overlay(o);
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_EQ(snapshot(base), before);
  EXPECT_EQ(made->replaced_keys.size(), 4u);
  Result<Checkpoint> derived = Checkpoint::open(tmp_ / "d");
  ASSERT_TRUE(derived.ok()) << derived.message();
  Result<KvScales> gate = load_kv_scales(*derived, KvCacheDtype::kE4m3);
  ASSERT_TRUE(gate.ok()) << gate.message();
  EXPECT_EQ(gate->v_scale[7], 0.03125f);
  EXPECT_EQ(gate->k_scale[3], 0.0171247218f);
  for (const auto& [name, value] : good_scales()) {
    EXPECT_EQ(derived->shard_of(name), std::string(kKvScalesShardName)) << name;
  }
  // Rewritten shards are new files; the others stay links; every base weight is where it was.
  for (const std::string& name : made->rewritten_shards) {
    EXPECT_FALSE(fs::is_symlink(tmp_ / "d" / name)) << name;
  }
  for (const std::string& name : ckpt->tensor_names()) {
    if (parse_scale_key(name)) continue;
    EXPECT_EQ(derived->shard_of(name), ckpt->shard_of(name)) << name;
    EXPECT_TRUE(std::equal(derived->find(name)->bytes.begin(), derived->find(name)->bytes.end(),
                           ckpt->find(name)->bytes.begin(), ckpt->find(name)->bytes.end()))
        << name;
  }
  VerifyOptions v;
  v.dir = tmp_ / "d";
  Result<VerifyResult> verified = verify_overlay(v);
  ASSERT_TRUE(verified.ok()) << verified.message();
  bool noted = false;
  for (const std::string& note : verified->notes) {
    noted |= contains(note, "4 K/V scale key(s) embedded in the base replaced");
  }
  EXPECT_TRUE(noted);

  // A rewritten shard changed afterwards fails verify.
  flip_last_byte(tmp_ / "d" / made->rewritten_shards.front());
  verified = verify_overlay(v);
  ASSERT_FALSE(verified.ok());
  EXPECT_TRUE(contains(verified.message(), "derived file " + made->rewritten_shards.front() +
                                               " no longer matches the file recorded"))
      << verified.message();
}

TEST_F(OverlayTest, ReplaceEmbeddedAliasScalesOfASingleFileBase) {
  const fs::path base = make_base(1);
  {
    Result<SafetensorsFile> file = SafetensorsFile::open(base / "model.safetensors");
    ASSERT_TRUE(file.ok());
    std::vector<SafetensorsWriteTensor> tensors;
    for (const SafetensorsTensor& t : file->tensors()) {
      tensors.push_back({t.name, t.dtype, t.shape, t.bytes});
    }
    const float nan = std::nanf("");
    tensors.push_back({"model.layers.7.self_attn.qkv_proj.v_scale",
                       DType::kF32,
                       {},
                       std::as_bytes(std::span<const float>(&nan, 1))});
    ASSERT_TRUE(write_safetensors(tmp_ / "rewritten.safetensors", tensors, {}).ok());
  }
  fs::rename(tmp_ / "rewritten.safetensors", base / "model.safetensors");
  OverlayOptions o = options(base, make_scales(good_scales()), tmp_ / "d");
  o.replace_embedded_scales = true;
  Result<OverlayResult> made = make_overlay(o);
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_EQ(made->replaced_keys,
            std::vector<std::string>{"model.layers.7.self_attn.qkv_proj.v_scale"});
  EXPECT_EQ(made->rewritten_shards, std::vector<std::string>{"model.safetensors"});
  // The revision is still the base's own file.
  EXPECT_EQ(made->base_revision, *sha256_file(base / "model.safetensors"));
  Result<Checkpoint> derived = Checkpoint::open(tmp_ / "d");
  ASSERT_TRUE(derived.ok()) << derived.message();
  EXPECT_EQ(derived->find("model.layers.7.self_attn.qkv_proj.v_scale"), nullptr);
  EXPECT_TRUE(load_kv_scales(*derived, KvCacheDtype::kE4m3).ok());
  VerifyOptions v;
  v.dir = tmp_ / "d";
  Result<VerifyResult> verified = verify_overlay(v);
  EXPECT_TRUE(verified.ok()) << verified.message();
}

TEST_F(OverlayTest, ReplaceEmbeddedScalesOmitsAShardOfOnlyScales) {
  const fs::path base = make_base(2);
  // A third shard that holds nothing but the scales, listed in the index.
  std::vector<float> values = {0.5f, 0.25f, 0.125f, 2.0f};
  const std::vector<std::string> keys = {
      "model.layers.3.self_attn.k_scale", "model.layers.3.self_attn.v_scale",
      "model.layers.7.self_attn.k_scale", "model.layers.7.self_attn.v_scale"};
  std::vector<SafetensorsWriteTensor> tensors;
  for (size_t i = 0; i < keys.size(); ++i) {
    tensors.push_back(
        {keys[i], DType::kF32, {}, std::as_bytes(std::span<const float>(&values[i], 1))});
  }
  ASSERT_TRUE(write_safetensors(base / "scales-only.safetensors", tensors, {}).ok());
  Json index = Json::parse(read_text(base / kSafetensorsIndexName));
  for (const std::string& key : keys) index["weight_map"][key] = "scales-only.safetensors";
  write_text(base / kSafetensorsIndexName, index.dump(2));
  ASSERT_TRUE(Checkpoint::open(base).ok());

  for (OverlayLinkMode mode : {OverlayLinkMode::kSymlink, OverlayLinkMode::kCopy}) {
    const fs::path out = tmp_ / cat("d_", overlay_link_mode_name(mode));
    OverlayOptions o = options(base, make_scales(good_scales()), out);
    o.replace_embedded_scales = true;
    o.link = mode;
    Result<OverlayResult> made = make_overlay(o);
    ASSERT_TRUE(made.ok()) << made.message();
    EXPECT_TRUE(made->rewritten_shards.empty());
    EXPECT_FALSE(fs::exists(fs::symlink_status(out / "scales-only.safetensors")));
    const Json merged = Json::parse(read_text(out / kSafetensorsIndexName));
    for (const std::string& key : keys) EXPECT_EQ(merged["weight_map"][key], kKvScalesShardName);
    Result<Checkpoint> derived = Checkpoint::open(out);
    ASSERT_TRUE(derived.ok()) << derived.message();
    Result<KvScales> gate = load_kv_scales(*derived, KvCacheDtype::kE4m3);
    ASSERT_TRUE(gate.ok()) << gate.message();
    EXPECT_EQ(gate->k_scale[3], 0.0171247218f);
    VerifyOptions v;
    v.dir = out;
    Result<VerifyResult> verified = verify_overlay(v);
    EXPECT_TRUE(verified.ok()) << verified.message();
  }
}

}  // namespace
}  // namespace e4kv
