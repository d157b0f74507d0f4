// WeightLoader's linear layers: the checkpoint's tensors of one module read into the canonical
// layout of quant/linear_weight.h on the host (every plane row-major over the output rows), cut
// or regrouped there, then uploaded.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/half.h"
#include "model/weights.h"

namespace e4kv {

namespace {

// One plane of a weight on the host: `rows` rows of row_bytes bytes; each entry of entry_bytes
// covers cols_per_entry input columns (a column slice keeps whole entries).
struct HostPlane {
  std::vector<std::byte> bytes;
  int64_t row_bytes = 0;
  int64_t entry_bytes = 1;
  int64_t cols_per_entry = 1;

  bool empty() const { return bytes.empty(); }
  int64_t rows() const { return row_bytes == 0 ? 0 : int64_t(bytes.size()) / row_bytes; }

  void take_rows(int64_t begin, int64_t count) { take_row_ranges({{begin, count}}); }
  // The rows of each range, one range after another.
  void take_row_ranges(const std::vector<RowRange>& ranges) {
    if (empty()) return;
    std::vector<std::byte> out;
    for (const RowRange& r : ranges) {
      out.insert(out.end(), bytes.begin() + long(r.begin * row_bytes),
                 bytes.begin() + long((r.begin + r.count) * row_bytes));
    }
    bytes = std::move(out);
  }
  // Input columns [c0, c1): entries [c0 / cols_per_entry, ceil(c1 / cols_per_entry)).
  void take_columns(int64_t c0, int64_t c1) {
    if (empty()) return;
    const int64_t e0 = c0 / cols_per_entry;
    const int64_t e1 = (c1 + cols_per_entry - 1) / cols_per_entry;
    const int64_t new_row = (e1 - e0) * entry_bytes;
    const int64_t n = rows();
    std::vector<std::byte> out(size_t(n * new_row));
    for (int64_t r = 0; r < n; ++r) {
      std::copy_n(bytes.begin() + long(r * row_bytes + e0 * entry_bytes), new_row,
                  out.begin() + long(r * new_row));
    }
    bytes = std::move(out);
    row_bytes = new_row;
  }
  void append(const HostPlane& other) {
    bytes.insert(bytes.end(), other.bytes.begin(), other.bytes.end());
  }
};

template <class T>
T load_le(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// AutoAWQ's GEMM packing: nibble i of a packed int32 holds column 8c + kAwqOrder[i].
constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// An AWQ-packed int32 tensor [rows, cols / 8] as nibbles transposed to [cols, rows] uint8.
std::vector<uint8_t> unpack_awq_transposed(const SafetensorsTensor& t, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out(size_t(rows * cols));
  const int64_t packed_cols = cols / 8;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < packed_cols; ++c) {
      const uint32_t word = load_le<uint32_t>(t.bytes.data() + (r * packed_cols + c) * 4);
      for (int i = 0; i < 8; ++i) {
        const int64_t col = c * 8 + kAwqOrder[i];
        out[size_t(col * rows + r)] = uint8_t((word >> (4 * i)) & 0xF);
      }
    }
  }
  return out;
}

// An AWQ-packed qweight [in, out / 8] int32 as the canonical W4 plane [out, in / 2]: byte k / 2 of
// row n holds column k in its low nibble and k + 1 in its high one. Blocks of kBlock input rows,
// so each output row receives a whole cache line per block and the source lines stay in L1 (the
// published checkpoints' expert weights are tens of GB: this loop is most of their load time).
void repack_awq_qweight(const SafetensorsTensor& t, int64_t in, int64_t out, std::byte* dst) {
  constexpr int64_t kBlock = 128;
  const int64_t packed_cols = out / 8;
  const int64_t row_bytes = in / 2;
  const std::byte* src = t.bytes.data();
  for (int64_t k0 = 0; k0 < in; k0 += kBlock) {
    const int64_t k1 = std::min(in, k0 + kBlock);
    for (int64_t c = 0; c < packed_cols; ++c) {
      std::byte* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = dst + (c * 8 + kAwqOrder[i]) * row_bytes;
      for (int64_t k = k0; k < k1; k += 2) {
        const auto w0 = load_le<uint32_t>(src + (k * packed_cols + c) * 4);
        const auto w1 = load_le<uint32_t>(src + ((k + 1) * packed_cols + c) * 4);
        // Nibble i of w0 and of w1 side by side: byte i of the interleave is (w1_i << 4) | w0_i.
        for (int i = 0; i < 8; ++i) {
          rows[i][k / 2] =
              std::byte(uint8_t(((w0 >> (4 * i)) & 0xFu) | (((w1 >> (4 * i)) & 0xFu) << 4)));
        }
      }
    }
  }
}

// A typed LinearWeight over its planes' buffers (data, scales, zeros, global; empty: none).
LinearWeight typed_weight(LinearView v, BackendBuffer (&buffers)[4]) {
  v.data = buffers[0].data();
  v.scales = buffers[1].data();
  v.zeros = buffers[2].empty() ? nullptr : buffers[2].data();
  v.global = buffers[3].empty() ? nullptr : buffers[3].as<float>();
  return LinearWeight(v, std::move(buffers[0]), std::move(buffers[1]), std::move(buffers[2]),
                      std::move(buffers[3]));
}

float scalar_float(const SafetensorsTensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF32:
      return load_le<float>(t.bytes.data() + i * 4);
    case DType::kF16:
      return f16_to_f32(load_le<uint16_t>(t.bytes.data() + i * 2));
    case DType::kBF16:
      return bf16_to_f32(load_le<uint16_t>(t.bytes.data() + i * 2));
    default:
      return NAN;
  }
}

}  // namespace

struct WeightLoader::HostLinear {
  LinearView view;  // format and shape; pointers unset
  DType dense_dtype = DType::kF32;
  // An untouched dense tensor, uploaded straight from the checkpoint's mapping.
  const SafetensorsTensor* dense_tensor = nullptr;
  HostPlane data;
  HostPlane scales;
  HostPlane zeros;
  HostPlane global;

  void materialize_dense() {
    if (dense_tensor == nullptr) return;
    data.bytes.assign(dense_tensor->bytes.begin(), dense_tensor->bytes.end());
    dense_tensor = nullptr;
  }
  HostPlane* planes(int i) {
    HostPlane* p[4] = {&data, &scales, &zeros, &global};
    return p[i];
  }
  // Back to a default HostLinear, keeping the planes' capacity.
  void reset() {
    view = LinearView{};
    dense_dtype = DType::kF32;
    dense_tensor = nullptr;
    for (int i = 0; i < 4; ++i) {
      HostPlane& p = *planes(i);
      p.bytes.clear();
      p.row_bytes = 0;
      p.entry_bytes = 1;
      p.cols_per_entry = 1;
    }
  }
};

Result<WeightLoader::HostLinear> WeightLoader::read_linear(const std::string& module, int64_t out,
                                                           int64_t in, std::string_view meaning,
                                                           HostLinear* reuse) {
  const QuantConfig& q = ckpt_->config().quant;
  const std::string dir = ckpt_->dir().string();
  auto fail = [&](const std::string& tensor, const std::string& what) {
    return Status::error(cat(dir, ": tensor ", tensor, " ", what));
  };
  auto expect_dtype = [&](const SafetensorsTensor& t, DType want) -> Status {
    if (t.dtype == want) return ok_status();
    return fail(t.name, cat("is ", dtype_name(t.dtype), "; the ", q.describe(),
                            " checkpoint format stores it as ", dtype_name(want)));
  };
  auto undeclared = [&](const std::string& tensor, std::string_view format) {
    return fail(tensor, cat("holds ", format, " weights but config.json's quantization_config is ",
                            q.describe(), "; the checkpoint and its config.json disagree"));
  };
  HostLinear h;
  if (reuse != nullptr) {
    h = std::move(*reuse);
    h.reset();
  }
  h.view.out = out;
  h.view.in = in;

  if (has(module + ".qweight")) {
    if (q.method != QuantMethod::kAwq) return undeclared(module + ".qweight", "AWQ");
    const int64_t g = q.group_size;
    if (in % g != 0 || out % 8 != 0) {
      return fail(module + ".qweight", cat("belongs to a [", out, ", ", in, "] projection (",
                                           meaning, "), which AWQ with group_size ", g,
                                           " cannot pack (in % ", g, " and out % 8 must be 0)"));
    }
    E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* qw,
                          find(module + ".qweight", {in, out / 8}, meaning));
    E4KV_RETURN_IF_ERROR(expect_dtype(*qw, DType::kI32));
    E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* sc,
                          find(module + ".scales", {in / g, out}, meaning));
    E4KV_RETURN_IF_ERROR(expect_dtype(*sc, DType::kF16));
    const SafetensorsTensor* qz = nullptr;
    if (has(module + ".qzeros")) {
      E4KV_ASSIGN_OR_RETURN(qz, find(module + ".qzeros", {in / g, out / 8}, meaning));
      E4KV_RETURN_IF_ERROR(expect_dtype(*qz, DType::kI32));
    } else if (q.zero_point) {
      return fail(module + ".qzeros",
                  "is missing (config.json's quantization_config has zero_point true)");
    }
    h.view.format = WeightFormat::kW4;
    h.view.group = g;
    h.data.row_bytes = in / 2;
    h.data.cols_per_entry = 2;
    h.data.bytes.resize(size_t(out * in / 2));
    repack_awq_qweight(*qw, in, out, h.data.bytes.data());
    const int64_t groups = in / g;
    h.scales.row_bytes = groups * 2;
    h.scales.entry_bytes = 2;
    h.scales.cols_per_entry = g;
    h.scales.bytes.resize(size_t(out * groups * 2));
    for (int64_t gi = 0; gi < groups; ++gi) {
      for (int64_t n = 0; n < out; ++n) {
        std::memcpy(h.scales.bytes.data() + (n * groups + gi) * 2,
                    sc->bytes.data() + (gi * out + n) * 2, 2);
      }
    }
    if (qz != nullptr) {
      const std::vector<uint8_t> z = unpack_awq_transposed(*qz, groups, out);  // [out, groups]
      h.zeros.row_bytes = groups;
      h.zeros.cols_per_entry = g;
      h.zeros.bytes.resize(z.size());
      std::memcpy(h.zeros.bytes.data(), z.data(), z.size());
    }
    return h;
  }

  if (has(module + ".weight_packed")) {
    if (q.method != QuantMethod::kNvfp4) return undeclared(module + ".weight_packed", "NVFP4");
    if (in % 16 != 0) {
      return fail(module + ".weight_packed",
                  cat("belongs to a [", out, ", ", in, "] projection (", meaning,
                      "), which NVFP4 cannot pack (in % 16 must be 0)"));
    }
    E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* wp,
                          find(module + ".weight_packed", {out, in / 2}, meaning));
    E4KV_RETURN_IF_ERROR(expect_dtype(*wp, DType::kU8));
    E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* ws,
                          find(module + ".weight_scale", {out, in / 16}, meaning));
    E4KV_RETURN_IF_ERROR(expect_dtype(*ws, DType::kF8E4M3));
    const std::string global_name = module + ".weight_global_scale";
    const SafetensorsTensor* gs = ckpt_->find(global_name);
    if (gs == nullptr) return fail(global_name, "is missing (an NVFP4 weight needs it)");
    if (gs->numel() != 1 || gs->shape.size() > 1 || gs->dtype != DType::kF32) {
      return fail(global_name, cat("is ", dtype_name(gs->dtype), " ", shape_text(gs->shape),
                                   "; expected one F32 value"));
    }
    mark_used(global_name);
    if (has(module + ".input_global_scale")) mark_used(module + ".input_global_scale");
    const float global = scalar_float(*gs, 0);
    if (!std::isfinite(global) || global <= 0.0f) {
      return fail(global_name, cat("is ", global, "; a global scale must be finite and positive"));
    }
    h.view.format = WeightFormat::kNvfp4;
    h.view.group = 16;
    h.data.row_bytes = in / 2;
    h.data.cols_per_entry = 2;
    h.data.bytes.assign(wp->bytes.begin(), wp->bytes.end());
    h.scales.row_bytes = in / 16;
    h.scales.cols_per_entry = 16;
    h.scales.bytes.assign(ws->bytes.begin(), ws->bytes.end());
    h.global.row_bytes = 4;
    h.global.entry_bytes = 4;
    h.global.cols_per_entry = in;  // one per row, whatever the columns
    h.global.bytes.resize(size_t(out * 4));
    for (int64_t n = 0; n < out; ++n) std::memcpy(h.global.bytes.data() + n * 4, &global, 4);
    return h;
  }

  E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* w, find(module + ".weight", {out, in}, meaning));
  if (w->dtype == DType::kF8E4M3) {
    if (q.method != QuantMethod::kFp8Block) return undeclared(w->name, "FP8");
    const int64_t bo = q.block_rows;
    const int64_t bi = q.group_size;
    const int64_t block_rows = (out + bo - 1) / bo;
    const int64_t block_cols = (in + bi - 1) / bi;
    E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* si,
                          find(module + ".weight_scale_inv", {block_rows, block_cols}, meaning));
    if (si->dtype != DType::kF32 && si->dtype != DType::kBF16 && si->dtype != DType::kF16) {
      return fail(si->name, cat("is ", dtype_name(si->dtype), "; block scales are F32 (or BF16)"));
    }
    for (const char* extra : {".input_scale", ".activation_scale"}) {
      if (has(module + extra)) mark_used(module + extra);  // activations stay FP16
    }
    h.view.format = WeightFormat::kFp8Block;
    h.view.group = bi;
    h.data.row_bytes = in;
    h.data.bytes.assign(w->bytes.begin(), w->bytes.end());
    h.scales.row_bytes = block_cols * 4;
    h.scales.entry_bytes = 4;
    h.scales.cols_per_entry = bi;
    h.scales.bytes.resize(size_t(out * block_cols * 4));
    for (int64_t n = 0; n < out; ++n) {
      for (int64_t b = 0; b < block_cols; ++b) {
        const float s = scalar_float(*si, (n / bo) * block_cols + b);
        if (!std::isfinite(s) || s <= 0.0f) {
          return fail(si->name, cat("holds ", s, " at [", n / bo, ", ", b,
                                    "]; a block scale must be finite and positive"));
        }
        std::memcpy(h.scales.bytes.data() + (n * block_cols + b) * 4, &s, 4);
      }
    }
    return h;
  }
  if (w->dtype != DType::kF32 && w->dtype != DType::kF16 && w->dtype != DType::kBF16) {
    return fail(w->name, cat("is ", dtype_name(w->dtype), "; dense weights are F32, F16 or BF16"));
  }
  h.view.format = WeightFormat::kDense;
  h.dense_dtype = w->dtype;
  h.dense_tensor = w;
  h.data.row_bytes = in * int64_t(dtype_size(w->dtype));
  h.data.entry_bytes = int64_t(dtype_size(w->dtype));
  return h;
}

Result<LinearWeight> WeightLoader::upload_linear(const std::string& module, HostLinear& h) {
  LinearView& v = h.view;
  if (!backend_->runs_weight_format(v.format)) {
    return Status::error(cat(ckpt_->dir().string(), ": ", module, " holds ",
                             weight_format_name(v.format), " weights, which the ", backend_->name(),
                             " backend does not run yet; run on the CPU "
                             "backend or use an FP16/BF16 checkpoint"));
  }
  if (v.format == WeightFormat::kDense) {
    SafetensorsTensor t;
    if (h.dense_tensor == nullptr) {
      t.name = module + ".weight";
      t.dtype = h.dense_dtype;
      t.shape = {v.out, v.in};
      t.end = h.data.bytes.size();
      t.bytes = std::span<const std::byte>(h.data.bytes.data(), h.data.bytes.size());
    }
    Result<BackendBuffer> buffer =
        backend_->upload_weight(h.dense_tensor != nullptr ? *h.dense_tensor : t);
    if (!buffer.ok()) return Status::error(cat(ckpt_->dir().string(), ": ", buffer.message()));
    return LinearWeight::dense(std::move(*buffer), v.out, v.in, int64_t(backend_->act_size()));
  }
  BackendBuffer buffers[4];
  for (int i = 0; i < 4; ++i) {
    const HostPlane& plane = *h.planes(i);
    if (plane.empty()) continue;
    E4KV_ASSIGN_OR_RETURN(buffers[i], backend_->allocate(plane.bytes.size()));
    backend_->copy_from_host(buffers[i].data(), plane.bytes.data(), plane.bytes.size());
  }
  return typed_weight(v, buffers);
}

Result<LinearWeight> WeightLoader::load_linear(const std::string& module, int64_t out, int64_t in,
                                               std::string_view meaning, const LinearSlice& slice) {
  E4KV_ASSIGN_OR_RETURN(HostLinear h, read_linear(module, out, in, meaning));
  if (slice.dim == LinearSlice::Dim::kRows) {
    E4KV_ASSERT(slice.begin >= 0 && slice.count > 0 && slice.begin + slice.count <= out,
                "load_linear: row slice out of range");
    h.materialize_dense();
    for (int i = 0; i < 4; ++i) h.planes(i)->take_rows(slice.begin, slice.count);
    h.view.out = slice.count;
  } else if (slice.dim == LinearSlice::Dim::kColumns) {
    E4KV_ASSERT(slice.begin >= 0 && slice.count > 0 && slice.begin + slice.count <= in,
                "load_linear: column slice out of range");
    const int64_t c0 = slice.begin;
    const int64_t c1 = slice.begin + slice.count;
    const int64_t unit = std::max<int64_t>({h.view.group, h.data.cols_per_entry, int64_t{1}});
    if (c0 % unit != 0 || (c1 % unit != 0 && c1 != in)) {
      return Status::error(cat(ckpt_->dir().string(), ": ", module, ": columns [", c0, ", ", c1,
                               ") do not fall on the ", weight_format_name(h.view.format),
                               " groups of ", unit,
                               " columns; choose a split whose parts are "
                               "multiples of the group size"));
    }
    h.materialize_dense();
    for (int i = 0; i < 3; ++i) h.planes(i)->take_columns(c0, c1);
    h.view.in = slice.count;
  }
  return upload_linear(module, h);
}

Result<LinearWeight> WeightLoader::load_linear_row_blocks(const std::string& module, int64_t out,
                                                          int64_t in, std::string_view meaning,
                                                          int64_t block_rows,
                                                          const std::vector<int64_t>& order) {
  E4KV_ASSERT(block_rows > 0 && out % block_rows == 0, "load_linear_row_blocks: bad blocks");
  std::vector<RowRange> ranges;
  for (int64_t block : order) {
    E4KV_ASSERT(block >= 0 && block < out / block_rows, "load_linear_row_blocks: bad block");
    ranges.push_back({block * block_rows, block_rows});
  }
  return load_linear_row_ranges(module, out, in, meaning, ranges);
}

Result<LinearWeight> WeightLoader::load_linear_row_ranges(const std::string& module, int64_t out,
                                                          int64_t in, std::string_view meaning,
                                                          const std::vector<RowRange>& ranges) {
  E4KV_ASSIGN_OR_RETURN(HostLinear h, read_linear(module, out, in, meaning));
  int64_t rows = 0;
  for (const RowRange& r : ranges) {
    E4KV_ASSERT(r.begin >= 0 && r.count > 0 && r.begin + r.count <= out,
                "load_linear_row_ranges: rows out of range");
    rows += r.count;
  }
  h.materialize_dense();
  for (int i = 0; i < 4; ++i) h.planes(i)->take_row_ranges(ranges);
  h.view.out = rows;
  return upload_linear(module, h);
}

Result<LinearWeight> WeightLoader::load_linear_concat(const std::vector<std::string>& modules,
                                                      int64_t out_each, int64_t in,
                                                      std::string_view meaning) {
  E4KV_ASSERT(!modules.empty(), "load_linear_concat: nothing to load");
  E4KV_ASSIGN_OR_RETURN(HostLinear h, read_linear(modules[0], out_each, in, meaning));
  const WeightFormat format = h.view.format;
  const int64_t group = h.view.group;
  const DType dense_dtype = h.dense_dtype;
  const bool has_zeros = !h.zeros.empty();
  // Module i's host planes, checked against module 0's format.
  auto check = [&](size_t i, const HostLinear& m) -> Status {
    if (m.view.format == format && m.view.group == group && m.dense_dtype == dense_dtype &&
        m.zeros.empty() == !has_zeros) {
      return ok_status();
    }
    return Status::error(cat(ckpt_->dir().string(), ": ", modules[i], " is stored as ",
                             weight_format_name(m.view.format), " but ", modules[0], " as ",
                             weight_format_name(format),
                             "; the runtime stacks them into one weight, so they must match"));
  };
  if (format == WeightFormat::kDense) {
    // Dense modules are converted to the backend's dtype as one tensor: stacked on the host.
    h.materialize_dense();
    h.data.bytes.reserve(h.data.bytes.size() * modules.size());
    for (size_t i = 1; i < modules.size(); ++i) {
      E4KV_ASSIGN_OR_RETURN(HostLinear m, read_linear(modules[i], out_each, in, meaning));
      E4KV_RETURN_IF_ERROR(check(i, m));
      m.materialize_dense();
      h.data.append(m.data);
      h.view.out += out_each;
    }
    return upload_linear(modules[0], h);
  }
  // Quantized modules (the routed experts: hundreds of modules a layer, tens of GB a model) go
  // to the backend one by one, each plane at its module's offset of one buffer, so no host copy
  // of the whole stack is built; module i is read into module i - 1's host buffers.
  if (!backend_->runs_weight_format(format)) return upload_linear(modules[0], h);
  const auto n = int64_t(modules.size());
  BackendBuffer buffers[4];
  size_t plane_bytes[4] = {};
  for (int p = 0; p < 4; ++p) {
    plane_bytes[p] = h.planes(p)->bytes.size();
    if (plane_bytes[p] == 0) continue;
    E4KV_ASSIGN_OR_RETURN(buffers[p], backend_->allocate(plane_bytes[p] * size_t(n)));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) {
      E4KV_ASSIGN_OR_RETURN(h, read_linear(modules[size_t(i)], out_each, in, meaning, &h));
      E4KV_RETURN_IF_ERROR(check(size_t(i), h));
    }
    for (int p = 0; p < 4; ++p) {
      const HostPlane& plane = *h.planes(p);
      // Equal by construction: every module was found with the same [out_each, in] shape.
      E4KV_ASSERT(plane.bytes.size() == plane_bytes[p],
                  cat("load_linear_concat: ", modules[size_t(i)], ": plane ", p, " is ",
                      plane.bytes.size(), " bytes, module 0's ", plane_bytes[p]));
      if (plane_bytes[p] == 0) continue;
      backend_->copy_from_host(
          static_cast<std::byte*>(buffers[p].data()) + plane_bytes[p] * size_t(i),
          plane.bytes.data(), plane_bytes[p]);
    }
  }
  LinearView v = h.view;
  v.out = out_each * n;
  return typed_weight(v, buffers);
}

namespace {

// part.rows, or every row when it is empty; each range checked against the part's rows.
std::vector<RowRange> part_rows(const LinearPart& part) {
  if (part.rows.empty()) return {{0, part.out}};
  for (const RowRange& r : part.rows) {
    E4KV_ASSERT(r.begin >= 0 && r.count > 0 && r.begin + r.count <= part.out,
                cat("LinearPart ", part.module, ": rows out of range"));
  }
  return part.rows;
}

bool all_rows(const LinearPart& part) {
  return part.rows.empty() ||
         (part.rows.size() == 1 && part.rows[0].begin == 0 && part.rows[0].count == part.out);
}

}  // namespace

Result<std::vector<WeightLoader::LinearStack>> WeightLoader::load_linear_stack(
    const std::vector<LinearPart>& parts, int64_t in) {
  E4KV_ASSERT(!parts.empty(), "load_linear_stack: no parts");
  std::vector<HostLinear> hosts;
  hosts.reserve(parts.size());
  for (const LinearPart& part : parts) {
    E4KV_ASSIGN_OR_RETURN(HostLinear h, read_linear(part.module, part.out, in, part.meaning));
    hosts.push_back(std::move(h));
  }
  auto same_format = [](const HostLinear& a, const HostLinear& b) {
    return a.view.format == b.view.format && a.view.group == b.view.group &&
           a.dense_dtype == b.dense_dtype && a.zeros.empty() == b.zeros.empty();
  };
  std::vector<LinearStack> out;
  for (size_t first = 0; first < parts.size();) {
    size_t end = first + 1;
    while (end < parts.size() && same_format(hosts[end], hosts[first])) ++end;
    for (size_t i = first; i < end; ++i) {
      if (end - first == 1 && all_rows(parts[i])) break;  // uploaded as it is
      HostLinear& h = hosts[i];
      h.materialize_dense();
      const std::vector<RowRange> ranges = part_rows(parts[i]);
      int64_t rows = 0;
      for (const RowRange& r : ranges) rows += r.count;
      for (int p = 0; p < 4; ++p) h.planes(p)->take_row_ranges(ranges);
      h.view.out = rows;
    }
    HostLinear& run = hosts[first];
    for (size_t i = first + 1; i < end; ++i) {
      for (int p = 0; p < 4; ++p) run.planes(p)->append(*hosts[i].planes(p));
      run.view.out += hosts[i].view.out;
      hosts[i] = HostLinear{};  // free the host copy early
    }
    E4KV_ASSIGN_OR_RETURN(LinearWeight w, upload_linear(parts[first].module, run));
    run = HostLinear{};
    out.push_back({std::move(w), end - first});
    first = end;
  }
  return out;
}

Result<BackendBuffer> WeightLoader::load_bias_stack(const std::vector<LinearPart>& parts) {
  std::vector<const SafetensorsTensor*> tensors;
  const SafetensorsTensor* first = nullptr;
  for (const LinearPart& part : parts) {
    const SafetensorsTensor* t = nullptr;
    if (part.bias) {
      E4KV_ASSIGN_OR_RETURN(t, find(part.module + ".bias", {part.out}, part.meaning));
      if (first == nullptr) {
        first = t;
      } else if (t->dtype != first->dtype) {
        return Status::error(cat(ckpt_->dir().string(), ": tensor ", t->name, " is ",
                                 dtype_name(t->dtype), " but ", first->name, " is ",
                                 dtype_name(first->dtype),
                                 "; the biases of one projection stack must share a dtype"));
      }
    }
    tensors.push_back(t);
  }
  E4KV_ASSERT(first != nullptr, "load_bias_stack: no part has a bias");
  const size_t elt = dtype_size(first->dtype);
  std::vector<std::byte> bytes;
  int64_t rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    for (const RowRange& r : part_rows(parts[i])) {
      if (tensors[i] != nullptr) {
        bytes.insert(bytes.end(), tensors[i]->bytes.begin() + long(size_t(r.begin) * elt),
                     tensors[i]->bytes.begin() + long(size_t(r.begin + r.count) * elt));
      } else {
        bytes.insert(bytes.end(), size_t(r.count) * elt, std::byte{0});
      }
      rows += r.count;
    }
  }
  return upload_host(first->name, first->dtype, {rows}, std::move(bytes));
}

}  // namespace e4kv
