// Loading a family's tensors by name: each one checked for presence and shape (the shape the
// config implies, named in the error), uploaded to the backend, and recorded, so that after the
// family has taken what it needs every tensor left over is an error naming it (a part of the
// model the runtime would silently skip). K/V scale keys and recomputed rotary buffers are never
// left over.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "io/checkpoint.h"
#include "quant/linear_weight.h"

namespace e4kv {

// A part of a linear weight to load: output rows, or input columns at whole groups of the
// format's scales (tensor parallelism's column- and row-parallel shares).
// Rows [begin, begin + count) of a tensor's first dimension.
struct RowRange {
  int64_t begin = 0;
  int64_t count = 0;
};

// One projection of a stack that reads the same input (q, k and v; gate and up): the module, its
// checkpoint rows and their meaning for errors, and the rows to keep (empty: all), one range after
// another; bias: the module has `module.bias` [out] (cut to the same rows).
struct LinearPart {
  std::string module;
  int64_t out = 0;
  std::string meaning;
  std::vector<RowRange> rows;
  bool bias = false;
};

struct LinearSlice {
  enum class Dim : uint8_t { kAll, kRows, kColumns };
  Dim dim = Dim::kAll;
  int64_t begin = 0;
  int64_t count = 0;
};

class WeightLoader {
 public:
  // family: how errors name what needs the tensors ("a llama checkpoint needs it").
  WeightLoader(const Checkpoint& ckpt, Backend& backend, std::string family);

  // The tensor `name` of exactly `shape`, uploaded. meaning: the shape in config terms
  // ("[hidden_size]").
  Result<BackendBuffer> load(const std::string& name, const std::vector<int64_t>& shape,
                             std::string_view meaning);
  // The tensors `names`, each of `part_shape` and one dtype, concatenated along their first
  // dimension and uploaded as one tensor (per-expert checkpoint tensors stacked into the packed
  // layout). meaning: as for load.
  Result<BackendBuffer> load_concat(const std::vector<std::string>& names,
                                    const std::vector<int64_t>& part_shape,
                                    std::string_view meaning);
  // The tensor `name` of `shape`, its rows regrouped: viewed as blocks of block_rows rows, block
  // order[i] becomes block i (an interleaved projection split into contiguous parts).
  Result<BackendBuffer> load_row_blocks(const std::string& name, const std::vector<int64_t>& shape,
                                        std::string_view meaning, int64_t block_rows,
                                        const std::vector<int64_t>& order);
  // Rows [begin, begin + count) of the tensor `name` of `shape` (its first dimension), uploaded:
  // a rank's share of a bias or a per-head parameter. count == shape[0]: the whole tensor.
  Result<BackendBuffer> load_rows(const std::string& name, const std::vector<int64_t>& shape,
                                  std::string_view meaning, int64_t begin, int64_t count);
  // The rows of each range of the tensor's first dimension, one range after another.
  Result<BackendBuffer> load_row_ranges(const std::string& name, const std::vector<int64_t>& shape,
                                        std::string_view meaning,
                                        const std::vector<RowRange>& ranges);
  // The tensor's checkpoint entry, checked for presence and shape, counted as used, not uploaded
  // (tensors a layer reads on the host, such as the PLE tables and their int64 buffers).
  Result<const SafetensorsTensor*> find(const std::string& name, const std::vector<int64_t>& shape,
                                        std::string_view meaning);
  bool has(const std::string& name) const { return ckpt_->find(name) != nullptr; }
  Backend& backend() const { return *backend_; }

  // ---- linear layers: dense or quantized, whichever the checkpoint holds ----
  // A linear module's weight of logical shape [out, in] (the checkpoint's `module`.weight, or the
  // tensors of config.json's quantization method: AWQ `.qweight/.qzeros/.scales`, NVFP4
  // `.weight_packed/.weight_scale/.weight_global_scale`, FP8 `.weight` + `.weight_scale_inv`),
  // in the canonical layout of quant/linear_weight.h, uploaded. Errors name the tensor: a shape
  // that disagrees with [out, in] or the method's packing, a dtype the format does not have,
  // quantized tensors that config.json does not declare, a format the backend does not run.
  // slice: the part to load (tensor parallelism).
  Result<LinearWeight> load_linear(const std::string& module, int64_t out, int64_t in,
                                   std::string_view meaning, const LinearSlice& slice = {});
  // The module's output rows of each range, one range after another (a rank's share of a fused
  // projection's parts).
  Result<LinearWeight> load_linear_row_ranges(const std::string& module, int64_t out, int64_t in,
                                              std::string_view meaning,
                                              const std::vector<RowRange>& ranges);
  // The module's weight with its output rows regrouped as load_row_blocks does (order may
  // select a subset of the blocks).
  Result<LinearWeight> load_linear_row_blocks(const std::string& module, int64_t out, int64_t in,
                                              std::string_view meaning, int64_t block_rows,
                                              const std::vector<int64_t>& order);
  // The modules' weights, each [out_each, in] and of one format, stacked along the output rows
  // (per-expert projections into the grouped layout the MoE ops read).
  Result<LinearWeight> load_linear_concat(const std::vector<std::string>& modules, int64_t out_each,
                                          int64_t in, std::string_view meaning);
  // The parts' weights, each of logical shape [part.out, in] cut to part.rows, in order: each
  // run of consecutive parts of one format (and group, zero points, dense dtype) stacked into
  // one weight (its rows the parts' rows, one part after another). A checkpoint that left some
  // parts unquantized gives one weight per run.
  struct LinearStack {
    LinearWeight weight;
    size_t n_parts = 0;
  };
  Result<std::vector<LinearStack>> load_linear_stack(const std::vector<LinearPart>& parts,
                                                     int64_t in);
  // The parts' `module.bias` vectors cut to part.rows, stacked in order and uploaded as one;
  // zeros for the rows of a part without one. At least one part must have a bias.
  Result<BackendBuffer> load_bias_stack(const std::vector<LinearPart>& parts);
  // Counts every tensor whose name starts with `prefix` as used; returns how many (weights of a
  // part of the checkpoint the runtime does not run, such as a vision tower).
  int64_t skip_prefix(std::string_view prefix);
  // Counts `name` as used without uploading it (a tied lm_head).
  void mark_used(const std::string& name) { use(name); }

  // Called with the bytes of the tensors taken so far (found for loading, marked or skipped) and
  // the checkpoint's tensor bytes, each time another 1% has been taken and at the end: a large
  // checkpoint's load takes minutes (the CLI draws a bar from it). Null: none.
  using Progress = std::function<void(uint64_t done_bytes, uint64_t total_bytes)>;
  void set_progress(Progress progress);

  // An error listing the tensors nothing loaded (at most 5 named, then the count).
  Status check_all_used() const;

 private:
  const Checkpoint* ckpt_;
  Backend* backend_;
  std::string family_;
  Result<BackendBuffer> upload_host(const std::string& name, DType dtype,
                                    std::vector<int64_t> shape, std::vector<std::byte> bytes);

  std::set<std::string, std::less<>> used_;
  // Records `name` as used and reports progress (a name already used counts once).
  void use(const std::string& name);
  Progress progress_;
  uint64_t total_bytes_ = 0;
  uint64_t done_bytes_ = 0;
  uint64_t reported_bytes_ = 0;

  struct HostLinear;
  // reuse: a HostLinear whose buffers (their capacity) the result takes over, so that loading
  // many modules of one shape allocates (and faults in) their host memory once.
  Result<HostLinear> read_linear(const std::string& module, int64_t out, int64_t in,
                                 std::string_view meaning, HostLinear* reuse = nullptr);
  Result<LinearWeight> upload_linear(const std::string& module, HostLinear& host);
};

std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace e4kv
