#include "backend/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cpu/cache_write.h"
#include "backend/cpu/gated_delta_net.h"
#include "backend/cpu/hyper_connection.h"
#include "backend/cpu/moe.h"
#include "backend/cpu/ple.h"
#include "backend/cpu/sampling.h"
#include "core/half.h"
#include "quant/dequantize.h"

namespace e4kv {
namespace {

constexpr size_t kAlignment = 64;

// Runs fn(begin, end) over [0, n) cut into at most n_threads contiguous ranges of at least
// min_per_thread items; small jobs run inline.
template <class Fn>
void parallel_for(int n_threads, int64_t n, int64_t min_per_thread, const Fn& fn) {
  if (n <= 0) return;
  const int64_t by_size = (n + min_per_thread - 1) / std::max<int64_t>(1, min_per_thread);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(n_threads, by_size));
  if (parts == 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + parts - 1) / parts;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(parts - 1));
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t begin = p * chunk;
    const int64_t end = std::min(n, begin + chunk);
    if (begin >= end) break;
    threads.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(int64_t{0}, std::min(n, chunk));
  for (std::thread& t : threads) t.join();
}

uint16_t load_u16_le(const std::byte* p) {
  return static_cast<uint16_t>(static_cast<unsigned>(p[0]) | (static_cast<unsigned>(p[1]) << 8));
}

// The CPU backend's cache-write statistics: host collectors, observed as the rows are written.
class HostKvWriteStats final : public KvWriteStats {
 public:
  std::pair<KvTensorStats, KvTensorStats> read() override { return {k, v}; }
  void reset() override {
    k = KvTensorStats();
    v = KvTensorStats();
  }

  KvTensorStats k, v;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options) {
    n_threads_ = options.n_threads > 0
                     ? options.n_threads
                     : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }

  std::string name() const override { return "cpu"; }
  DType act_dtype() const override { return DType::kF32; }

  // Graphs, emulated for tests of the engine's step graphs (cpu_backend_emulate_graphs): a
  // "capture" keeps the function and a replay calls it again. The CPU has no launch cost to save.
  bool supports_graphs() const override { return emulate_graphs_; }
  Result<std::unique_ptr<BackendGraph>> capture_graph(
      const std::function<Status()>& issue) override {
    if (!emulate_graphs_) return Status::error("cpu: this backend does not record graphs");
    class Replay final : public BackendGraph {
     public:
      explicit Replay(std::function<Status()> issue) : issue_(std::move(issue)) {}
      Status replay() override { return issue_(); }

     private:
      std::function<Status()> issue_;
    };
    return std::unique_ptr<BackendGraph>(new Replay(issue));
  }
  void set_emulate_graphs(bool on) { emulate_graphs_ = on; }

  Result<DeviceMemoryInfo> device_memory() const override {
    return Status::error(
        "cpu: device memory is not applicable (the CPU backend's memory is the host's)");
  }

  Result<BackendBuffer> allocate(size_t bytes) override {
    const size_t rounded =
        std::max<size_t>(kAlignment, (bytes + kAlignment - 1) & ~(kAlignment - 1));
    void* data = std::aligned_alloc(kAlignment, rounded);
    if (data == nullptr) {
      return Status::error(cat("cpu backend: cannot allocate ", bytes, " bytes of host memory"));
    }
    std::memset(data, 0, rounded);
    return BackendBuffer(this, data, bytes);
  }

  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  void fill_zero(void* dst, size_t bytes) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
  }
  Status copy_blocks(void* pool, int64_t n_blocks, size_t block_bytes,
                     std::span<const BlockCopy> copies) override {
    E4KV_RETURN_IF_ERROR(validate_block_copies(n_blocks, copies));
    auto* base = static_cast<std::byte*>(pool);
    for (const BlockCopy& c : copies) {
      std::memcpy(base + size_t(c.dst) * block_bytes, base + size_t(c.src) * block_bytes,
                  block_bytes);
    }
    return ok_status();
  }
  void synchronize() override {}

  Result<BackendBuffer> upload_weight(const SafetensorsTensor& tensor) override {
    const int64_t n = tensor.numel();
    if (tensor.dtype != DType::kF32 && tensor.dtype != DType::kF16 &&
        tensor.dtype != DType::kBF16) {
      return Status::error(cat("tensor ", tensor.name, " has dtype ", dtype_name(tensor.dtype),
                               "; the dense runtime loads F32, F16 or BF16 weights"));
    }
    E4KV_ASSIGN_OR_RETURN(BackendBuffer buffer, allocate(static_cast<size_t>(n) * sizeof(float)));
    float* out = buffer.as<float>();
    const std::byte* in = tensor.bytes.data();
    if (tensor.dtype == DType::kF32) {
      std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
    } else if (tensor.dtype == DType::kF16) {
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(load_u16_le(in + 2 * i));
    } else {
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(load_u16_le(in + 2 * i));
    }
    return buffer;
  }

  Status gather_rows(const void* table, const int32_t* index, int64_t n, int64_t dim,
                     void* out) override {
    const float* src = static_cast<const float*>(table);
    float* dst = static_cast<float*>(out);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(dst + i * dim, src + int64_t(index[i]) * dim, size_t(dim) * sizeof(float));
    }
    return ok_status();
  }

  Status rms_norm(const void* x, const void* weight, int64_t n_rows, int64_t dim, float eps,
                  RmsNormForm form, void* out) override {
    const float* in = static_cast<const float*>(x);
    const float* w = static_cast<const float*>(weight);
    float* o = static_cast<float*>(out);
    parallel_for(n_threads_, n_rows, rows_per_thread(dim), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* row = in + r * dim;
        float sum_squares = 0.0f;
        for (int64_t j = 0; j < dim; ++j) {
          const float square = row[j] * row[j];
          sum_squares += square;
        }
        const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(dim) + eps);
        float* dst = o + r * dim;
        for (int64_t j = 0; j < dim; ++j) {
          const float gain = form == RmsNormForm::kOnePlusWeight ? 1.0f + w[j] : w[j];
          const float normed = row[j] * inv_rms;
          dst[j] = normed * gain;
        }
      }
    });
    return ok_status();
  }

  Status linear(const void* x, const void* w, const void* bias, int64_t n, int64_t in, int64_t out,
                void* y, DType y_dtype) override {
    E4KV_ASSERT(y_dtype == DType::kF32, "cpu linear: y_dtype must be F32");
    if (n == 0) return ok_status();
    float* yf = static_cast<float*>(y);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(n),
                static_cast<blasint>(out), static_cast<blasint>(in), 1.0f,
                static_cast<const float*>(x), static_cast<blasint>(in),
                static_cast<const float*>(w), static_cast<blasint>(in), 0.0f, yf,
                static_cast<blasint>(out));
    if (bias != nullptr) {
      const float* b = static_cast<const float*>(bias);
      for (int64_t r = 0; r < n; ++r) {
        float* row = yf + r * out;
        for (int64_t j = 0; j < out; ++j) row[j] += b[j];
      }
    }
    return ok_status();
  }

  using Backend::linear;
  using Backend::moe_experts;

  bool runs_weight_format(WeightFormat) const override { return true; }

  // Tiles of output rows dequantized (quant/dequantize.h, in parallel) into fp32, then multiplied
  // as linear() does: the reference the quantized kernels are checked against.
  Status linear_quantized(const void* x, const LinearView& w, const void* bias, int64_t n, void* y,
                          DType y_dtype) override {
    E4KV_ASSERT(y_dtype == DType::kF32, "cpu linear: y_dtype must be F32");
    if (n == 0) return ok_status();
    constexpr int64_t kTileRows = 256;
    const int64_t tile_rows = std::min(kTileRows, w.out);
    std::vector<float> tile(size_t(tile_rows * w.in));
    float* yf = static_cast<float*>(y);
    for (int64_t r0 = 0; r0 < w.out; r0 += tile_rows) {
      const int64_t rows = std::min(tile_rows, w.out - r0);
      parallel_for(n_threads_, rows, 8, [&](int64_t begin, int64_t end) {
        dequantize_rows(w, r0 + begin, end - begin, tile.data() + begin * w.in);
      });
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(n),
                  static_cast<blasint>(rows), static_cast<blasint>(w.in), 1.0f,
                  static_cast<const float*>(x), static_cast<blasint>(w.in), tile.data(),
                  static_cast<blasint>(w.in), 0.0f, yf + r0, static_cast<blasint>(w.out));
    }
    if (bias != nullptr) {
      const float* b = static_cast<const float*>(bias);
      for (int64_t r = 0; r < n; ++r) {
        float* row = yf + r * w.out;
        for (int64_t j = 0; j < w.out; ++j) row[j] += b[j];
      }
    }
    return ok_status();
  }

  Status rope_neox(void* x, const float* cos, const float* sin, int64_t n_rows, int64_t n_heads,
                   int64_t head_dim, int64_t rotary_dim) override {
    E4KV_ASSERT(rotary_dim % 2 == 0 && rotary_dim <= head_dim, "rope_neox: bad rotary_dim");
    float* data = static_cast<float*>(x);
    const int64_t half = rotary_dim / 2;
    parallel_for(n_threads_, n_rows, rows_per_thread(n_heads * head_dim),
                 [&](int64_t begin, int64_t end) {
                   for (int64_t r = begin; r < end; ++r) {
                     const float* c = cos + r * half;
                     const float* s = sin + r * half;
                     for (int64_t h = 0; h < n_heads; ++h) {
                       float* row = data + (r * n_heads + h) * head_dim;
                       for (int64_t i = 0; i < half; ++i) {
                         const float a = row[i];
                         const float b = row[i + half];
                         const float ac = a * c[i];
                         const float bs = b * s[i];
                         const float bc = b * c[i];
                         const float as = a * s[i];
                         row[i] = ac - bs;
                         row[i + half] = bc + as;
                       }
                     }
                   }
                 });
    return ok_status();
  }

  Status silu_mul(const void* gate, const void* up, void* out, int64_t n) override {
    const float* g = static_cast<const float*>(gate);
    const float* u = static_cast<const float*>(up);
    float* o = static_cast<float*>(out);
    parallel_for(n_threads_, n, kElemsPerThread, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float silu = g[i] / (1.0f + std::exp(-g[i]));
        o[i] = silu * u[i];
      }
    });
    return ok_status();
  }

  Status add(void* x, const void* y, int64_t n) override {
    float* a = static_cast<float*>(x);
    const float* b = static_cast<const float*>(y);
    for (int64_t i = 0; i < n; ++i) a[i] += b[i];
    return ok_status();
  }

  Status convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) override {
    if (src_dtype == dst_dtype) {
      std::memmove(dst, src, static_cast<size_t>(n) * dtype_size(src_dtype));
      return ok_status();
    }
    if (src_dtype == DType::kF32 && dst_dtype == DType::kF16) {
      const float* in = static_cast<const float*>(src);
      uint16_t* out = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(in[i]);
      return ok_status();
    }
    if (src_dtype == DType::kF16 && dst_dtype == DType::kF32) {
      const uint16_t* in = static_cast<const uint16_t*>(src);
      float* out = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(in[i]);
      return ok_status();
    }
    return Status::error(cat("cpu backend: no conversion from ", dtype_name(src_dtype), " to ",
                             dtype_name(dst_dtype)));
  }

  Status cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                     const int64_t* slot_mapping, int64_t n_tokens, unsigned long long* non_finite,
                     KvWriteStats* stats) override {
    const CacheWriteStats counts = e4kv::cache_write(cache, k, v, slot_mapping, n_tokens);
    if (non_finite != nullptr) {
      non_finite[0] += static_cast<unsigned long long>(counts.k_non_finite);
      non_finite[1] += static_cast<unsigned long long>(counts.v_non_finite);
    }
    if (stats != nullptr) {
      auto& host = static_cast<HostKvWriteStats&>(*stats);
      const int64_t row = cache.geometry.row_elems();
      for (int64_t t = 0; t < n_tokens; ++t) {
        if (slot_mapping[t] < 0) continue;
        host.k.observe(k + t * row, row);
        host.v.observe(v + t * row, row);
      }
    }
    return ok_status();
  }
  Result<std::unique_ptr<KvWriteStats>> make_kv_write_stats() override {
    return std::unique_ptr<KvWriteStats>(std::make_unique<HostKvWriteStats>());
  }

  // Rows are planned where they run: the reference needs no step plan.
  Status paged_attention(const PagedAttentionParams& params) override {
    E4KV_RETURN_IF_ERROR(validate_paged_attention(params, /*need_out=*/true));
    const int64_t n_rows = params.rows.n_rows;
    const int64_t row_elems = params.n_heads * params.cache.geometry.head_dim;
    // Rows are independent: each thread runs the reference over a contiguous subset of them.
    std::mutex mutex;
    Status first_error;
    parallel_for(n_threads_, n_rows, 1, [&](int64_t begin, int64_t end) {
      PagedAttentionParams part = params;
      part.rows.n_rows = end - begin;
      part.rows.row_seq += begin;
      part.rows.row_pos += begin;
      if (part.rows.sel_tokens != nullptr) {
        part.rows.sel_tokens += begin * part.rows.sel_width;
        part.rows.sel_counts += begin;
      }
      part.q += begin * row_elems;
      if (part.gate != nullptr) part.gate += begin * row_elems;
      part.out += begin * row_elems;
      Status status = e4kv::paged_attention(part);
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(mutex);
        if (first_error.ok()) first_error = std::move(status);
      }
    });
    return first_error;
  }

  // ---- hybrid-model ops: the CPU references of backend/cpu/ and qsa/ ----
  bool has_hybrid_ops() const override { return true; }

  Status rms_norm_grouped(const void* x, const void* weight, int64_t n_rows, int64_t n_groups,
                          int64_t dim, float eps, RmsNormForm form, void* out) override {
    e4kv::rms_norm_grouped(f32(x), f32(weight), n_rows, n_groups, dim, eps, form, f32(out));
    return ok_status();
  }
  Status silu_scaled(const void* x, int64_t n, float scale, void* out) override {
    e4kv::silu_scaled(f32(x), n, scale, f32(out));
    return ok_status();
  }
  Status hc_mix(const void* up, const void* xn, int64_t n_rows, int64_t n_streams, int64_t hidden,
                void* mix) override {
    e4kv::hc_mix(f32(up), f32(xn), n_rows, n_streams, hidden, f32(mix));
    return ok_status();
  }
  Status hc_inject(void* x, const void* y, const void* inj, int64_t n_rows, int64_t n_streams,
                   int64_t hidden) override {
    e4kv::hc_inject(f32(x), f32(y), f32(inj), n_rows, n_streams, hidden);
    return ok_status();
  }
  Status hc_expand(const void* e, int64_t n_rows, int64_t n_streams, int64_t hidden,
                   void* x) override {
    e4kv::hc_expand(f32(e), n_rows, n_streams, hidden, f32(x));
    return ok_status();
  }

  Status conv1d_silu(const void* x, int64_t channels, const void* weight, int64_t kernel,
                     int64_t dilation, void* states, const SequenceRowsView& seqs,
                     void* out) override {
    const int64_t state_elems = (kernel - 1) * dilation * channels;
    for (int64_t s = 0; s < seqs.n_seqs; ++s) {
      const int64_t begin = seqs.row_begin[s];
      const int64_t n = seqs.row_begin[s + 1] - begin;
      float* state = f32(states) + int64_t(seqs.state_slot[s]) * state_elems;
      dilated_conv1d_silu(f32(x) + begin * channels, n, channels, f32(weight), kernel, dilation,
                          state, f32(out) + begin * channels);
    }
    return ok_status();
  }

  Status gated_delta_gates(const void* a, const void* b, const void* a_log, const void* dt_bias,
                           int64_t n_rows, int64_t n_heads, float* g, float* beta) override {
    e4kv::gated_delta_gates(f32(a), f32(b), f32(a_log), f32(dt_bias), n_rows, n_heads, g, beta);
    return ok_status();
  }

  Status gated_delta_rule(const void* qkv, const float* g, const float* beta, int64_t n_k_heads,
                          int64_t n_v_heads, int64_t head_k_dim, int64_t head_v_dim, float* states,
                          const SequenceRowsView& seqs, void* out) override {
    const int64_t k_dim = n_k_heads * head_k_dim;
    const int64_t v_dim = n_v_heads * head_v_dim;
    const int64_t width = 2 * k_dim + v_dim;
    const int64_t state_elems = n_v_heads * head_k_dim * head_v_dim;
    std::vector<float> q, k, v;
    for (int64_t s = 0; s < seqs.n_seqs; ++s) {
      const int64_t begin = seqs.row_begin[s];
      const int64_t n = seqs.row_begin[s + 1] - begin;
      q.resize(size_t(n * k_dim));
      k.resize(size_t(n * k_dim));
      v.resize(size_t(n * v_dim));
      for (int64_t r = 0; r < n; ++r) {
        const float* row = f32(qkv) + (begin + r) * width;
        std::memcpy(q.data() + r * k_dim, row, size_t(k_dim) * sizeof(float));
        std::memcpy(k.data() + r * k_dim, row + k_dim, size_t(k_dim) * sizeof(float));
        std::memcpy(v.data() + r * v_dim, row + 2 * k_dim, size_t(v_dim) * sizeof(float));
      }
      GatedDeltaRuleParams params;
      params.n_tokens = n;
      params.n_k_heads = n_k_heads;
      params.n_v_heads = n_v_heads;
      params.head_k_dim = head_k_dim;
      params.head_v_dim = head_v_dim;
      params.q = q.data();
      params.k = k.data();
      params.v = v.data();
      params.g = g + begin * n_v_heads;
      params.beta = beta + begin * n_v_heads;
      params.state = states + int64_t(seqs.state_slot[s]) * state_elems;
      params.out = f32(out) + begin * v_dim;
      // As transformers: the recurrent form for one token with a state, the chunked one otherwise.
      if (n == 1 && seqs.start_pos[s] > 0) {
        gated_delta_rule_recurrent(params);
      } else {
        gated_delta_rule_chunked(params);
      }
    }
    return ok_status();
  }

  Status gated_rms_norm(const void* x, const void* z, const void* weight, int64_t n_rows,
                        int64_t dim, float eps, bool sigmoid_gate, void* out) override {
    e4kv::gated_rms_norm(f32(x), f32(z), f32(weight), n_rows, dim, eps,
                         sigmoid_gate ? GateActivation::kSigmoid : GateActivation::kSilu, f32(out));
    return ok_status();
  }

  Status qsa_indexer_write(const IndexerCompressedView& compressed, const IndexerRingView& rings,
                           const uint16_t* index_k, const SequenceRowsView& seqs,
                           const BlockTableView& block_table,
                           const IndexerKeyNormRope& norm_rope) override {
    IndexerWriteBatch batch;
    batch.index_k = index_k;
    batch.token_offsets = seqs.row_begin;
    batch.start_pos = seqs.start_pos;
    batch.ring_index = seqs.state_slot;
    batch.n_seqs = seqs.n_seqs;
    batch.block_tables = block_table;
    indexer_cache_write(compressed, rings, batch, norm_rope);
    return ok_status();
  }

  Status qsa_select(const QsaSelectionConfig& config, const IndexerCompressedView& compressed,
                    const BlockTableView& block_table, const QueryBatchView& rows,
                    const uint16_t* index_q, int32_t* sel_tokens, int32_t* sel_counts) override {
    return e4kv::qsa_select(config, compressed, block_table, rows, index_q, sel_tokens, sel_counts);
  }

  Status sample_rows(const float* logits, int64_t vocab, const SampleRowParams* params, int64_t n,
                     int32_t* tokens, int32_t* non_finite) override {
    for (int64_t j = 0; j < n; ++j) {
      const std::span<const float> row(logits + size_t(params[j].logit_row) * size_t(vocab),
                                       size_t(vocab));
      tokens[j] = sample_row(row, params[j], &non_finite[j]);
    }
    return ok_status();
  }

  Status moe_route(const float* logits, int64_t n_rows, int64_t n_experts, int64_t top_k,
                   bool norm_topk_prob, int32_t* ids, float* weights) override {
    e4kv::moe_route(logits, n_rows, n_experts, top_k, norm_topk_prob, ids, weights);
    return ok_status();
  }
  Status moe_experts(const void* x, const void* gate_up, const void* down, int64_t n_experts,
                     int64_t hidden, int64_t inter, const int32_t* ids, const float* weights,
                     int64_t n_rows, int64_t top_k, void* out) override {
    MoeExpertsView experts;
    experts.gate_up = f32(gate_up);
    experts.down = f32(down);
    experts.n_experts = n_experts;
    experts.hidden = hidden;
    experts.inter = inter;
    e4kv::moe_experts(experts, f32(x), n_rows, ids, weights, top_k, f32(out));
    return ok_status();
  }
  Status moe_local_ids(int32_t* ids, int64_t n_rows, int64_t top_k, int64_t begin,
                       int64_t count) override {
    for (int64_t i = 0; i < n_rows * top_k; ++i) {
      ids[i] = ids[i] >= begin && ids[i] < begin + count ? int32_t(ids[i] - begin) : -1;
    }
    return ok_status();
  }
  Status moe_experts_quantized(const void* x, const LinearView& gate_up, const LinearView& down,
                               int64_t n_experts, int64_t hidden, int64_t inter,
                               const int32_t* ids, const float* weights, int64_t n_rows,
                               int64_t top_k, void* out) override {
    MoeExpertsView experts;
    if (gate_up.dense()) {
      experts.gate_up = f32(gate_up.data);
    } else {
      experts.gate_up_q = &gate_up;
    }
    if (down.dense()) {
      experts.down = f32(down.data);
    } else {
      experts.down_q = &down;
    }
    experts.n_experts = n_experts;
    experts.hidden = hidden;
    experts.inter = inter;
    e4kv::moe_experts(experts, f32(x), n_rows, ids, weights, top_k, f32(out));
    return ok_status();
  }
  Status sigmoid_gated_add(void* out, const void* y, const void* gate, int64_t n_rows,
                           int64_t dim) override {
    e4kv::sigmoid_gated_add(f32(out), f32(y), f32(gate), n_rows, dim);
    return ok_status();
  }
  Status ple_gate(const void* kn, const void* qn, const void* val, int64_t n_rows,
                  int64_t n_streams, int64_t hidden, void* out) override {
    e4kv::ple_gate(f32(kn), f32(qn), f32(val), n_rows, n_streams, hidden, f32(out));
    return ok_status();
  }

 protected:
  void release(void* data) override { std::free(data); }

 private:
  bool emulate_graphs_ = false;
  static float* f32(void* p) { return static_cast<float*>(p); }
  static const float* f32(const void* p) { return static_cast<const float*>(p); }

  static constexpr int64_t kElemsPerThread = 1 << 15;
  static int64_t rows_per_thread(int64_t row_elems) {
    return std::max<int64_t>(1, kElemsPerThread / std::max<int64_t>(1, row_elems));
  }

  int n_threads_ = 1;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

void cpu_backend_emulate_graphs(Backend& backend, bool on) {
  if (auto* cpu = dynamic_cast<CpuBackend*>(&backend)) cpu->set_emulate_graphs(on);
}

}  // namespace e4kv
