// libFuzzer target for the Hugging Face config files: parse_model_config (config.json), the KV
// cache geometry derived from it (kv_cache_layout, kv_capacity, request_concurrency: the sizes
// `e4kv capacity` and model load compute from a config), and load_eos_token_ids (the eos ids of
// config.json and generation_config.json). Every input must either be rejected with a one-line
// message naming the file, or accepted with a config whose invariants hold (model_config.h); any
// broken property traps, and an E4KV_ASSERT or a signed overflow reached from the input is a
// crash (UBSan halts on the first report).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "io/generation_config.h"
#include "io/model_config.h"
#include "kv/block_allocator.h"
#include "kv/capacity.h"

namespace {

namespace fs = std::filesystem;

constexpr const char* kSource = "fuzz/config.json";

void require(bool condition) {
  if (!condition) __builtin_trap();
}

void require_one_line(const std::string& message, const std::string& prefix) {
  require(message.starts_with(prefix + ": "));
  require(message.find('\n') == std::string::npos);
}

// A directory of its own for the file-reading parsers, removed at exit.
const fs::path& scratch_dir() {
  static const fs::path dir = [] {
    // tmpfs when there is one: two file writes per input are most of the run time on a disk.
    std::error_code ec;
    const fs::path base = fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0
                              ? fs::path("/dev/shm")
                              : fs::temp_directory_path();
    std::string pattern = (base / "e4kv_config_fuzz.XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      std::perror("config_json_fuzz: mkdtemp");
      std::abort();
    }
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(scratch_dir(), ec);
    });
    return fs::path(pattern);
  }();
  return dir;
}

void write_file(const fs::path& path, std::string_view text) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  require(file != nullptr);
  require(std::fwrite(text.data(), 1, text.size(), file) == text.size());
  require(std::fclose(file) == 0);
}

void check_config(const e4kv::ModelConfig& config) {
  constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();
  require(config.vocab_size > 0 && config.vocab_size <= kMaxSize);
  require(config.hidden_size > 0 && config.hidden_size <= kMaxSize);
  require(config.intermediate_size >= 0 && config.intermediate_size <= kMaxSize);
  require(config.n_layers > 0);
  require(static_cast<int64_t>(config.layers.size()) == config.n_layers);
  require(config.n_heads > 0 && config.n_heads <= kMaxSize);
  require(config.n_kv_heads > 0 && config.n_kv_heads <= kMaxSize);
  require(config.n_heads % config.n_kv_heads == 0);
  require(config.head_dim > 0 && config.head_dim <= kMaxSize);
  require(config.rotary_dim > 0 && config.rotary_dim % 2 == 0 &&
          config.rotary_dim <= config.head_dim);
  require(config.rms_norm_eps > 0.0);
  require(config.max_position_embeddings >= 0);
  require(!config.sliding_window || *config.sliding_window > 0);
  require(config.rope.theta > 0.0 && config.rope.factor > 0.0);
  require(config.rope.partial_rotary_factor > 0.0 && config.rope.partial_rotary_factor <= 1.0);

  const int64_t n_qsa = config.count_layers(e4kv::LayerKind::kQsaAttention);
  require(config.qsa.has_value() == (n_qsa > 0));
  if (config.qsa) {
    const e4kv::QsaConfig& qsa = *config.qsa;
    require(qsa.n_index_heads > 0 && qsa.n_index_kv_heads == 1);
    require(qsa.index_dim >= config.rotary_dim);
    require(qsa.ratio > 0 && qsa.budget > 0 && qsa.budget % qsa.ratio == 0);
  }
  if (config.count_layers(e4kv::LayerKind::kSlidingAttention) > 0) {
    require(config.sliding_window.has_value());
  }
  int64_t n_kv = 0;
  for (e4kv::LayerKind kind : config.layers) n_kv += e4kv::layer_has_kv_cache(kind) ? 1 : 0;
  require(static_cast<int64_t>(config.kv_cache_layers().size()) == n_kv);
}

// The sizes a command computes from a config: every one is either an error or a figure that fits.
void check_geometry(const e4kv::ModelConfig& config) {
  const int64_t request_tokens = config.max_position_embeddings > 0
                                     ? config.max_position_embeddings
                                     : std::numeric_limits<int32_t>::max();
  for (int64_t block_size : {int64_t{16}, int64_t{64}, e4kv::kMaxBlockSize}) {
    e4kv::Result<e4kv::KvCacheLayout> layout = e4kv::kv_cache_layout(config, block_size);
    if (!layout.ok()) {
      require(layout.message().find('\n') == std::string::npos);
      continue;
    }
    for (e4kv::KvCacheDtype dtype : {e4kv::KvCacheDtype::kF16, e4kv::KvCacheDtype::kE4m3}) {
      require(layout->block_bytes(dtype) > 0);
      require(layout->ring_bytes_per_seq() >= 0);
      for (int64_t budget : {int64_t{1} << 30, std::numeric_limits<int64_t>::max()}) {
        e4kv::Result<e4kv::KvCapacity> capacity = e4kv::kv_capacity(*layout, dtype, budget, 1);
        if (capacity.ok()) {
          require(capacity->n_blocks >= 0 && capacity->n_tokens >= 0);
          require(capacity->pool_bytes >= 0 && capacity->pool_bytes <= budget);
        }
        e4kv::Result<e4kv::RequestConcurrency> concurrency =
            e4kv::request_concurrency(*layout, dtype, budget, request_tokens);
        if (concurrency.ok()) {
          require(concurrency->blocks_per_request > 0 && concurrency->bytes_per_request > 0);
          require(concurrency->max_requests >= 0 && concurrency->max_concurrency >= 0.0);
        }
      }
    }
  }
}

void check_eos_ids(std::string_view text) {
  const fs::path& dir = scratch_dir();
  write_file(dir / "config.json", text);
  write_file(dir / "generation_config.json", text);
  e4kv::Result<std::vector<int32_t>> ids = e4kv::load_eos_token_ids(dir);
  if (!ids.ok()) {
    require(ids.message().starts_with(dir.string() + "/"));
    require(ids.message().find('\n') == std::string::npos);
    return;
  }
  for (size_t i = 0; i < ids->size(); ++i) {
    require((*ids)[i] >= 0);
    require(i == 0 || (*ids)[i - 1] < (*ids)[i]);  // sorted, no duplicates
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  e4kv::Result<e4kv::ModelConfig> config = e4kv::parse_model_config(text, kSource);
  if (config.ok()) {
    check_config(*config);
    check_geometry(*config);
  } else {
    require_one_line(config.message(), kSource);
  }
  check_eos_ids(text);
  return 0;
}
