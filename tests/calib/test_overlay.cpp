// make_overlay and verify_overlay (DESIGN.md section 7): the base tree is byte- and mtime-identical
// afterwards; the merged index, scales shard and provenance are right; the derived directory
// passes the start-up gate; every refusal leaves nothing behind; verify catches a changed base and
// a removed scale.
#include "calib/overlay.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
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
    tmp_ = fs::temp_directory_path() /
           cat("e4kv_overlay_", info->name(), "_", ::getpid(), "_", counter++);
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
  EXPECT_EQ(n_files, n_shards > 1 ? 2 + static_cast<size_t>(n_shards) : 2u);
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
}

TEST_F(OverlayTest, HashScopeIndexConfig) {
  const fs::path base = make_base(3);
  OverlayOptions o = options(base, make_scales(good_scales()), tmp_ / "d");
  o.hash = OverlayHashScope::kIndexConfig;
  Result<OverlayResult> made = make_overlay(o);
  ASSERT_TRUE(made.ok()) << made.message();
  EXPECT_EQ(made->n_hashed, 2);
  const Json provenance = Json::parse(read_text(tmp_ / "d" / kProvenanceName));
  EXPECT_EQ(provenance["hash_scope"], "index-config");
  EXPECT_EQ(provenance["base"]["files"].size(), 2u);
  VerifyOptions v;
  v.dir = tmp_ / "d";
  Result<VerifyResult> verified = verify_overlay(v);
  ASSERT_TRUE(verified.ok()) << verified.message();
  ASSERT_EQ(verified->notes.size(), 2u);
  EXPECT_TRUE(contains(verified->notes[1], "--hash index-config")) << verified->notes[1];

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
  expect_refused(options(base, tmp_, out), "not a regular file");

  OverlayOptions both = options(base, make_scales(good_scales()), out);
  both.unit_scale_negative_control = true;
  expect_refused(both, "not both");
  expect_refused(options(base, "", out), "--scales is required");
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

}  // namespace
}  // namespace e4kv
