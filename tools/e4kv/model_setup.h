// What `generate` and `logits` share: the model flags (device, KV cache dtype and scales, block
// size, max model length, pool size) over the library's model loading (api/model_setup.h, which
// the public API uses too), with errors naming the flags and the load's notes printed.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "api/model_setup.h"
#include "backend/backend.h"
#include "core/status.h"

namespace e4kv::cli {

// The model flags are the library's ModelSetup (api/model_setup.h); the functions below name them
// as flags in errors. (A type of its own, so a call with flags picks these over the library's.)
struct ModelFlags : ModelSetup {};

// Adds MODEL and the flags above to `cmd`.
void add_model_flags(CLI::App* cmd, ModelFlags& flags);

// Adds the pool sizing flags (--kv-cache-memory-bytes, --num-gpu-blocks-override,
// --gpu-memory-utilization) to `cmd`: the commands that serve requests (generate, bench).
void add_pool_flags(CLI::App* cmd, ModelFlags& flags);

// The ranges of the numeric flags above; errors name the flag. load_model checks them too.
Status validate_model_flags(const ModelFlags& flags);

using LoadedModel = e4kv::LoadedModel;

// "cpu", "cuda" or "cuda:N". A binary built without the CUDA backend says so for cuda.
Result<std::unique_ptr<Backend>> make_backend(const std::string& device, int threads);

// e4kv::load_model (api/model_setup.h) with the flags' names in errors; the notes go to stderr.
// Opens the checkpoint, picks the backend and loads the model. The KV pool: as a pool flag says
// (refused when it cannot hold one sequence of the max model length), or else enough blocks for
// `n_seqs` sequences of `tokens` tokens each (capped at the max model length). all_rows > 0: one
// forward of that many rows returns the logits of every row (the logits command); otherwise the
// model's default limits. To stderr: the pool line (blocks, tokens, FP16-equivalent tokens, the
// maximum concurrency at the max model length), then for an E4M3 cache the K/V scale summary (in
// unit mode it is the NEGATIVE CONTROL line).
Result<LoadedModel> load_model(const ModelFlags& flags, int64_t tokens, int64_t all_rows = 0,
                               int64_t n_seqs = 1);

// "1,2,3" (spaces allowed) -> ids; errors name `flag`.
Result<std::vector<int32_t>> parse_id_list(const std::string& flag, const std::string& text);

// The weights' load on a terminal: "e4kv: loading weights x / y GB (n%) t s", redrawn with '\r'
// by callback() (null when stderr is not a terminal: logs stay clean), ended by finish().
class LoadProgressLine {
 public:
  LoadProgressLine();
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> callback();
  void finish(bool ok);

 private:
  bool terminal_ = false;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace e4kv::cli
