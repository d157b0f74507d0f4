// The op set the model runtime runs on: one abstract Backend with a CPU implementation
// (backend/cpu/cpu_backend.h, the oracle) and a CUDA one. Ops work on plain pointers into backend
// memory; shapes are given on every pointer. No CUDA header here.
//
// Contract shared by every backend:
//   - Asynchrony: ops and copy_from_host are ordered with each other (a CUDA backend runs them on
//     one stream) and may return before they finish. An op never reads backend data on the host;
//     the per-batch metadata (ids, positions, slot mapping, block tables, cos/sin tables, row
//     lists) is built on the host by the model and copied in with copy_from_host first.
//     copy_to_host and synchronize wait for every earlier op.
//   - Activation dtype: act_dtype() is the element type of activations and of uploaded weights:
//     kF32 on the CPU (weights widened from F16/BF16 at upload), kF16 on CUDA (BF16 converted at
//     upload; accumulation in fp32). Pointers documented as "act" hold act_dtype() elements.
//   - Errors: ops return a Status for shapes a backend does not support (a CUDA kernel's limits);
//     out-of-range indices are the caller's bug (the model validates metadata on the host first).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/attention_params.h"
#include "backend/attention_plan.h"
#include "core/dtype.h"
#include "core/rms_norm_form.h"
#include "core/status.h"
#include "io/safetensors.h"
#include "kv/block_allocator.h"
#include "kv/kv_cache_view.h"
#include "kv/kv_histogram.h"
#include "qsa/indexer_cache.h"
#include "qsa/selection.h"
#include "quant/linear_view.h"

namespace e4kv {

class Backend;

// Checks copy_blocks' arguments on the host (ids in range, src != dst); every backend calls it.
Status validate_block_copies(int64_t n_blocks, std::span<const BlockCopy> copies);

// The rows of each sequence in one forward, for ops that carry per-sequence state (conv windows,
// recurrent states, indexer rings). Rows of sequence s are [row_begin[s], row_begin[s + 1]) at
// consecutive positions from start_pos[s]; state_slot[s] is its slot in the state pools. Device
// pointers, and the launch facts the host decided once for the step (StepContext), so that an op
// never reads a host array to shape its launch.
struct SequenceRowsView {
  int64_t n_seqs = 0;
  const int32_t* row_begin = nullptr;   // [n_seqs + 1]
  const int32_t* state_slot = nullptr;  // [n_seqs]
  const int64_t* start_pos = nullptr;   // [n_seqs]
  int64_t first_row = 0;                // row_begin[0]
  int64_t end_row = 0;                  // row_begin[n_seqs]
  int64_t max_seq_rows = 0;             // the most rows one sequence has (1 or 0: a decode step)
  int64_t max_end_pos = 0;              // the largest start_pos[s] + its rows
};

// Fills the launch facts of `view` (first_row .. max_end_pos) from host copies of its row_begin
// [n_seqs + 1] and start_pos [n_seqs].
void set_sequence_launch_facts(SequenceRowsView& view, const int32_t* host_row_begin,
                               const int64_t* host_start_pos);

// Host memory for staging uploads (Backend::allocate_host), freed through its backend. Move-only.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(Backend* backend, void* data, size_t bytes)
      : backend_(backend), data_(data), bytes_(bytes) {}
  ~HostBuffer() { reset(); }
  HostBuffer(HostBuffer&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)) {}
  HostBuffer& operator=(HostBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      backend_ = std::exchange(other.backend_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void reset();

 private:
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// An allocation in a backend's memory, freed through that backend. Move-only.
class BackendBuffer {
 public:
  BackendBuffer() = default;
  BackendBuffer(Backend* backend, void* data, size_t bytes)
      : backend_(backend), data_(data), bytes_(bytes) {}
  ~BackendBuffer() { reset(); }
  BackendBuffer(BackendBuffer&& other) noexcept
      : backend_(std::exchange(other.backend_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)) {}
  BackendBuffer& operator=(BackendBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      backend_ = std::exchange(other.backend_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void reset();

 private:
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// The memory of a backend's device, the whole card's (other processes' allocations included).
struct DeviceMemoryInfo {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
  std::string device_name;  // the card's own name, e.g. "NVIDIA H100 80GB HBM3"
};

// The statistics (kv/kv_histogram.h) of the K and V values that cache writes received, accumulated
// where the backend runs them (Backend::make_kv_write_stats).
class KvWriteStats {
 public:
  virtual ~KvWriteStats() = default;
  // Waits for every earlier op of the backend, then returns {K, V} accumulated since creation or
  // the last reset().
  virtual std::pair<KvTensorStats, KvTensorStats> read() = 0;
  // Zeroes the accumulators (ordered with the backend's ops).
  virtual void reset() = 0;
};

// A recorded sequence of a backend's ops (a CUDA graph on a CUDA backend): replay() issues them
// again, in order with the backend's other ops, on whatever the device buffers they read hold then.
class BackendGraph {
 public:
  virtual ~BackendGraph() = default;
  virtual Status replay() = 0;
  // The operations the graph holds (kernels, copies, ...: CUDA's graph nodes), -1 where the
  // backend does not count them.
  virtual int64_t n_nodes() const { return -1; }
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu", "cuda:0", ... for messages.
  virtual std::string name() const = 0;
  // kF32 or kF16: activations and weights (see the contract above).
  virtual DType act_dtype() const = 0;
  size_t act_size() const { return dtype_size(act_dtype()); }

  // ---- memory ----
  // `bytes` of backend memory, zero-filled. An error names the size when memory is short.
  virtual Result<BackendBuffer> allocate(size_t bytes) = 0;
  // The device's free and total memory now, for sizing the KV pool by a utilization target
  // (--gpu-memory-utilization). Errors where the backend has no device memory of its own: the CPU
  // backend's memory is the host's, so the question is not applicable there.
  virtual Result<DeviceMemoryInfo> device_memory() const {
    return Status::error(cat(name(), ": device memory is not applicable to this backend"));
  }
  // dst (backend) <- src (host). The host memory may be reused as soon as the call returns,
  // except memory from allocate_host: a copy from it runs in order with the ops (a CUDA graph can
  // hold it), so its bytes must stay unchanged until the next synchronize or copy_to_host.
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  // `bytes` of zero-filled host memory for staging uploads: page-locked on a CUDA backend, plain
  // memory on the CPU.
  virtual Result<HostBuffer> allocate_host(size_t bytes);
  // dst (host) <- src (backend), after every earlier op has finished.
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  // Zero-fills `bytes` of backend memory (ordered with the ops).
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  // Whole-block copies inside one pool of equal blocks, with the result of doing them one after
  // another in the order given: block copies[i].dst becomes a copy of block copies[i].src. The
  // model runs it on every layer's paged memory (main K/V blocks, QSA compressed indexer rows) for
  // the engine's copy-on-write of a forked sequence's shared last block, and on each per-sequence
  // state pool (a slot is a block) to start a forked sequence from its parent's state.
  // pool: [n_blocks, block_bytes] bytes; copies: host pairs. Errors: an id outside [0, n_blocks),
  // src == dst.
  virtual Status copy_blocks(void* pool, int64_t n_blocks, size_t block_bytes,
                             std::span<const BlockCopy> copies) = 0;
  // Waits for every earlier op.
  virtual void synchronize() = 0;
  // Uploads a checkpoint tensor (F32, F16 or BF16; any shape, numel elements) converted to
  // act_dtype(). Errors name the tensor: another dtype; for a kF16 backend, a finite value beyond
  // the FP16 range (|x| > 65504 after rounding) in an F32 or BF16 tensor.
  virtual Result<BackendBuffer> upload_weight(const SafetensorsTensor& tensor) = 0;

  // ---- ops (all pointers in backend memory) ----

  // out[i] = table[index[i]].
  // table: [n_table, dim] act; index: [n] int32, each in [0, n_table); out: [n, dim] act
  virtual Status gather_rows(const void* table, const int32_t* index, int64_t n, int64_t dim,
                             void* out) = 0;

  // Row-wise RMSNorm: out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * g, g = weight (kWeight) or
  // 1 + weight (kOnePlusWeight); mean and rsqrt in fp32. Per-head q/k norms view [n, heads, dim]
  // as [n * heads, dim].
  // x: [n_rows, dim] act; weight: [dim] act; out: [n_rows, dim] act (may alias x)
  virtual Status rms_norm(const void* x, const void* weight, int64_t n_rows, int64_t dim, float eps,
                          RmsNormForm form, void* out) = 0;

  // y = x W^T (+ bias), fp32 accumulation.
  // x: [n, in] act; w: [out, in] act (the checkpoint's row-major layout); bias: [out] act or
  // nullptr; y: [n, out] of y_dtype, which is act_dtype() or kF32 (logits)
  virtual Status linear(const void* x, const void* w, const void* bias, int64_t n, int64_t in,
                        int64_t out, void* y, DType y_dtype) = 0;

  // The same for a typed weight (quant/linear_view.h): kDense calls linear() above, a quantized
  // format linear_quantized(). w.out and w.in give the shape.
  Status linear(const void* x, const LinearView& w, const void* bias, int64_t n, void* y,
                DType y_dtype);
  // Whether linear_quantized and moe_experts_quantized run `format`; the loader refuses a
  // checkpoint whose weights the backend cannot run, naming the tensor (kDense: always).
  virtual bool runs_weight_format(WeightFormat format) const {
    return format == WeightFormat::kDense;
  }
  // y = x W^T (+ bias) with W dequantized as quant/dequantize.h defines it (fp32 products and
  // accumulation; a kernel's summation order is its own). x: [n, w.in] act; bias: [w.out] act or
  // nullptr; y: [n, w.out] of y_dtype (act or kF32).
  virtual Status linear_quantized(const void* x, const LinearView& w, const void* bias, int64_t n,
                                  void* y, DType y_dtype);

  // In-place partial NeoX RoPE (rotate-half): for each row r, head h and i < rotary_dim / 2, with
  // a = x[r, h, i], b = x[r, h, i + rotary_dim / 2], c = cos[r, i], s = sin[r, i]:
  //   x[r, h, i] = a * c - b * s;  x[r, h, i + rotary_dim / 2] = b * c + a * s
  // (fp32 math); dims [rotary_dim, head_dim) are unchanged. The tables come from the host (any
  // scaling type and attention factor already folded in).
  // x: [n_rows, n_heads, head_dim] act; cos, sin: [n_rows, rotary_dim / 2] fp32
  virtual Status rope_neox(void* x, const float* cos, const float* sin, int64_t n_rows,
                           int64_t n_heads, int64_t head_dim, int64_t rotary_dim) = 0;

  // out = silu(gate) * up, silu(g) = g / (1 + exp(-g)), fp32 math.
  // gate, up, out: [n] act (out may alias gate or up)
  virtual Status silu_mul(const void* gate, const void* up, void* out, int64_t n) = 0;

  // x += y. x, y: [n] act
  virtual Status add(void* x, const void* y, int64_t n) = 0;
  // The residual add and the next norm in one: x += y (rounded to act, as add), then
  // out = rms_norm(x) (as rms_norm). x, y: [n_rows, dim] act; weight: [dim] act; out: [n_rows,
  // dim] act (not aliasing x or y). The default runs add then rms_norm.
  virtual Status add_rms_norm(void* x, const void* y, const void* weight, int64_t n_rows,
                              int64_t dim, float eps, RmsNormForm form, void* out);

  // dst = src converted element-wise (round to nearest even). Supported pairs: act -> kF16 (q, k,
  // v for the cache and attention), kF32 -> act (attention output), and a dtype to itself.
  // src: [n] of src_dtype; dst: [n] of dst_dtype (FP16 as uint16_t bits)
  virtual Status convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                         int64_t n) = 0;

  // Writes K/V token rows into one layer's paged cache, exactly as backend/cpu/cache_write.h
  // defines it (FP16 stored as is; E4M3 = e4m3_satfinite_rne(x / scale)).
  // k, v: [n_tokens, n_kv_heads, head_dim] FP16 bits; slot_mapping: [n_tokens] int64, -1 = skip;
  // non_finite: [2] (K, V) counters of inf/NaN inputs, accumulated (zero them with fill_zero);
  // stats: nullptr, or accumulators (make_kv_write_stats) that also receive the magnitude
  // statistics of the K and V values of the rows written (skipped rows are not observed).
  virtual Status cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                             const int64_t* slot_mapping, int64_t n_tokens,
                             unsigned long long* non_finite, KvWriteStats* stats) = 0;
  // Accumulators for cache_write's statistics (calibration, DESIGN.md section 6), zeroed; one per
  // KV-cache layer. Backend memory, owned by the returned object.
  virtual Result<std::unique_ptr<KvWriteStats>> make_kv_write_stats() = 0;

  // ---- attention: planned on the host once per step, run by every layer ----
  // At load: the shapes of the model's attention layers and the step limits (rows of one forward,
  // keys of the longest sequence). A backend sizes its plan buffers and attention workspaces here,
  // so that neither plan_attention nor paged_attention allocates. A backend that plans nothing
  // does nothing.
  virtual Status reserve_attention(std::span<const AttentionLayerShape> /*shapes*/,
                                   int64_t /*max_rows*/, int64_t /*max_seq_tokens*/) {
    return ok_status();
  }
  // Once per step, before the step's first op: plans the launches (routes, split-K) of every
  // reserved shape for these rows and uploads what the kernels read (ordered with the ops).
  // host_rows: row_seq and row_pos on the host. Errors: a shape no route runs.
  virtual Status plan_attention(const QueryBatchView& /*host_rows*/) { return ok_status(); }
  // params.out = paged attention of every row (backend/cpu/attention.h is the definition): q FP16
  // bits after norm and RoPE, out fp32 [n_rows, n_heads, head_dim], with this step's plan of the
  // layer's shape (plan_attention). Errors: a shape that was not reserved and planned.
  virtual Status paged_attention(const PagedAttentionParams& params) = 0;

  // ---- sampling ----
  // One row of sample_rows (engine/sampler.h defines the draw; core/sampling_noise.h the noise).
  struct SampleRowParams {
    uint64_t seed = 0;
    uint64_t counter = 0;          // the request's draw number (its tokens sampled so far)
    float inv_temperature = 0.0f;  // 1 / temperature; 0: greedy
    float log_min_p = -INFINITY;   // log(min_p); -inf: no min-p
    int32_t logit_row = 0;         // the row of `logits` this draw reads
    int32_t reserved = 0;
  };
  // For each params[j] (a row r = params[j].logit_row of logits [.., vocab] fp32):
  //   non_finite[j] = the number of NaN or infinite logits of row r (the token is then undefined);
  //   greedy: tokens[j] = the index of the largest logit, the lowest among equals;
  //   else, with s_i = logit_i * inv_temperature and m = max_i s_i: tokens[j] = the index i
  //   maximising s_i + G(seed, counter, i) over the i with s_i >= m + log_min_p (the lowest among
  //   equals), G = -log(-log(sampling_uniform(sampling_draw_key(seed, counter), i))), fp32.
  // backend/cpu/sampling.h is the definition. params, tokens, non_finite: [n] in backend memory.
  virtual Status sample_rows(const float* logits, int64_t vocab, const SampleRowParams* params,
                             int64_t n, int32_t* tokens, int32_t* non_finite) = 0;

  // ---- hybrid-model ops (Qwen4Exp: hyper-connections, GatedDeltaNet, QSA indexer, MoE, PLE) ----
  // A backend without them returns false here and an error from each; the model refuses to load
  // on it with a message naming the backend.
  virtual bool has_hybrid_ops() const { return false; }

  // Sizes the workspaces of the ops below for the largest forward, at load, so that a forward does
  // not allocate (the engine will replay decode steps from CUDA graphs). An op that finds its
  // workspace too small grows it (an allocation and a wait for the device) where
  // allow_workspace_growth(true), and returns an error naming the workspace otherwise. A backend
  // without workspaces does nothing.
  struct HybridWorkspaceNeeds {
    int64_t max_rows = 0;  // rows of one forward
    // QSA: compressed groups of the longest sequence, and the indexer's RoPE (positions < max).
    int64_t qsa_max_groups = 0;
    const double* rope_inv_freq = nullptr;  // [rotary_dim / 2], kept alive by the caller
    int64_t rotary_dim = 0;
    int64_t max_positions = 0;
    // MoE (0 experts: none).
    int64_t moe_experts = 0;
    int64_t moe_top_k = 0;
    int64_t moe_hidden = 0;
    int64_t moe_inter = 0;
  };
  virtual Status reserve_hybrid_workspaces(const HybridWorkspaceNeeds& /*needs*/) {
    return ok_status();
  }
  // Off: a forward that outgrows a reserved workspace fails instead of growing it (tests, debug
  // builds). On by default in release builds, off in debug builds.
  virtual void allow_workspace_growth(bool /*allowed*/) {}

  // ---- graphs of the decode step (engine/step_graphs.h) ----
  // Whether capture_graph records here (CUDA; the CPU backend only when emulating, for tests).
  virtual bool supports_graphs() const { return false; }
  // Records what `issue` launches on this backend without running it; the graph's replay() runs
  // it. `issue` must only launch: an allocation, a wait for the device or a copy from pageable
  // memory fails the capture (CUDA's global capture mode). Errors: no graphs here, `issue`'s own
  // error, an op the capture cannot hold.
  virtual Result<std::unique_ptr<BackendGraph>> capture_graph(
      const std::function<Status()>& /*issue*/) {
    return Status::error(cat(name(), ": this backend does not record graphs"));
  }
  // A hash of the launch parameters the step's host half chose (the attention plans' split
  // counts, ...): a graph captured after one step's host half replays another's only where the
  // signatures are equal. 0 where nothing is planned per step.
  virtual uint64_t launch_signature() const { return 0; }

  // Grouped RMSNorm: x [n_rows, n_groups, dim] act, each group row normalised over its dim,
  // gain weight[g * dim + i] (kWeight) or 1 + weight[...] (kOnePlusWeight); weight: [n_groups *
  // dim] act; out may alias x. n_groups = 1 is rms_norm.
  virtual Status rms_norm_grouped(const void* x, const void* weight, int64_t n_rows,
                                  int64_t n_groups, int64_t dim, float eps, RmsNormForm form,
                                  void* out);
  // out[i] = silu(x[i] * scale). x, out: [n] act (may alias).
  virtual Status silu_scaled(const void* x, int64_t n, float scale, void* out);
  // A hyper-connection block's whole input mix for a few rows (decode steps), where the backend
  // has a fused form (model/layers/hyper_connection.h): the composition of rms_norm_grouped
  // (kOnePlusWeight) of x, linear(down), silu_scaled(1 / streams), linear(up), hc_mix and, when
  // `inject` is given, linear(inject) into inj, each intermediate rounded to act as those ops
  // store it. Returns false, doing nothing, for a shape without the fused form (the caller runs
  // the composition). x: [n_rows, streams * hidden] act; norm_weight: [streams * hidden]; down:
  // [rank, streams * hidden]; up: [streams * hidden, rank]; inject: [streams, streams * hidden]
  // or null; mix: [n_rows, hidden]; inj: [n_rows, streams] act (null with inject); scratch:
  // backend memory of scratch_bytes. pending_y / pending_inj (both or neither): the previous
  // block's injection, not yet applied: the mix reads x as hc_inject(x, pending_y, pending_inj)
  // would leave it and leaves x so (pending_inj must not be inj).
  virtual Result<bool> hc_mix_fused(void* /*x*/, const void* /*norm_weight*/, const void* /*down*/,
                                    const void* /*up*/, const void* /*inject*/, int64_t /*n_rows*/,
                                    int64_t /*streams*/, int64_t /*hidden*/, int64_t /*rank*/,
                                    float /*eps*/, void* /*mix*/, void* /*inj*/, void* /*scratch*/,
                                    size_t /*scratch_bytes*/, const void* /*pending_y*/,
                                    const void* /*pending_inj*/) {
    return false;
  }
  // Hyper-connection input mixer: mix[r] = mean over streams s of sigmoid(up[r, s]) * xn[r, s].
  // up, xn: [n_rows, n_streams, hidden] act; mix: [n_rows, hidden] act
  virtual Status hc_mix(const void* up, const void* xn, int64_t n_rows, int64_t n_streams,
                        int64_t hidden, void* mix);
  // Injection: x[r, s] += 2 * sigmoid(inj[r, s] / n_streams) * y[r].
  // x: [n_rows, n_streams, hidden] act; y: [n_rows, hidden] act; inj: [n_rows, n_streams] act
  virtual Status hc_inject(void* x, const void* y, const void* inj, int64_t n_rows,
                           int64_t n_streams, int64_t hidden);
  // x[r, s] = e[r] for every stream. e: [n_rows, hidden] act; x: [n_rows, n_streams, hidden] act
  virtual Status hc_expand(const void* e, int64_t n_rows, int64_t n_streams, int64_t hidden,
                           void* x);

  // Depthwise causal conv (kernel taps `dilation` apart) + SiLU over each sequence's rows,
  // carrying the last (kernel - 1) * dilation inputs of each sequence in its state slot.
  // x, out: [n_rows, channels] act (no alias); weight: [channels, kernel] act;
  // states: [n_slots, (kernel - 1) * dilation, channels] act, oldest input first
  virtual Status conv1d_silu(const void* x, int64_t channels, const void* weight, int64_t kernel,
                             int64_t dilation, void* states, const SequenceRowsView& seqs,
                             void* out);
  // GatedDeltaNet gates (backend/cpu/gated_delta_net.h): g = -exp(a_log) softplus(a + dt_bias),
  // beta = sigmoid(b). a, b: [n_rows, n_heads] act; a_log, dt_bias: [n_heads] act;
  // g, beta: [n_rows, n_heads] fp32
  virtual Status gated_delta_gates(const void* a, const void* b, const void* a_log,
                                   const void* dt_bias, int64_t n_rows, int64_t n_heads, float* g,
                                   float* beta);
  // The gated delta rule over each sequence's rows (recurrent for one row, chunked otherwise),
  // q/k l2-normalised inside. qkv: [n_rows, 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim]
  // act, q | k | v contiguous in each row (the conv output); g, beta: [n_rows, n_v_heads] fp32;
  // states: [n_slots, n_v_heads, head_k_dim, head_v_dim] fp32; out: [n_rows, n_v_heads,
  // head_v_dim] act
  virtual Status gated_delta_rule(const void* qkv, const float* g, const float* beta,
                                  int64_t n_k_heads, int64_t n_v_heads, int64_t head_k_dim,
                                  int64_t head_v_dim, float* states, const SequenceRowsView& seqs,
                                  void* out);
  // gated_delta_gates of (a, b, a_log, dt_bias) and then gated_delta_rule, for a backend that
  // computes the gates inside the rule (the same values, one launch fewer). Returns false, doing
  // nothing, where the backend has no such form (the caller runs the two ops). a, b: [n_rows,
  // n_v_heads] act; the rest as the two ops.
  virtual Result<bool> gated_delta_rule_raw_gates(const void* /*qkv*/, const void* /*a*/,
                                                  const void* /*b*/, const void* /*a_log*/,
                                                  const void* /*dt_bias*/, int64_t /*n_k_heads*/,
                                                  int64_t /*n_v_heads*/, int64_t /*head_k_dim*/,
                                                  int64_t /*head_v_dim*/, float* /*states*/,
                                                  const SequenceRowsView& /*seqs*/, void* /*out*/) {
    return false;
  }
  // out = rnd(w * (x / rms(x))) * act(z) per row (Qwen4Exp's gated RMSNorm, plain weight).
  // x, z, out: [n_rows, dim] act (out may alias); weight: [dim] act
  virtual Status gated_rms_norm(const void* x, const void* z, const void* weight, int64_t n_rows,
                                int64_t dim, float eps, bool sigmoid_gate, void* out);

  // QSA indexer write (qsa/indexer_cache.h): pushes each sequence's raw index keys through its
  // ring and writes the compressed row of every group that completes.
  // index_k: [n_rows, index_dim] FP16 bits; seqs: the rows of each sequence (state slot = ring)
  virtual Status qsa_indexer_write(const IndexerCompressedView& compressed,
                                   const IndexerRingView& rings, const uint16_t* index_k,
                                   const SequenceRowsView& seqs, const BlockTableView& block_table,
                                   const IndexerKeyNormRope& norm_rope);
  // QSA selection of every row (qsa/selection.h): sel_tokens [n_rows, budget + ratio - 1],
  // sel_counts [n_rows]. index_q: [n_rows, n_index_heads, index_dim] FP16 bits.
  virtual Status qsa_select(const QsaSelectionConfig& config,
                            const IndexerCompressedView& compressed,
                            const BlockTableView& block_table, const QueryBatchView& rows,
                            const uint16_t* index_q, int32_t* sel_tokens, int32_t* sel_counts);

  // MoE router (backend/cpu/moe.h): softmax over n_experts, top_k (ties: lower id), optional
  // renormalisation. logits: [n_rows, n_experts] fp32 (the router projection with fp32 output:
  // FP16 logits would reorder experts closer than their rounding); ids: [n_rows, top_k] int32;
  // weights: [n_rows, top_k] fp32
  virtual Status moe_route(const float* logits, int64_t n_rows, int64_t n_experts, int64_t top_k,
                           bool norm_topk_prob, int32_t* ids, float* weights);
  // Routed experts: out[r] = sum_j weights[r, j] * down_e(silu(gate_e x) * up_e x); an id of -1
  // contributes nothing (moe_local_ids).
  // x: [n_rows, hidden] act; gate_up: [n_experts, 2 * inter, hidden] act (gate rows first);
  // down: [n_experts, hidden, inter] act; out: [n_rows, hidden] act (overwritten)
  virtual Status moe_experts(const void* x, const void* gate_up, const void* down,
                             int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                             const float* weights, int64_t n_rows, int64_t top_k, void* out);
  // Expert parallelism: ids [n_rows, top_k] of the whole model's experts become ids of this
  // rank's experts [begin, begin + count) (id - begin), and -1 for the others, which moe_experts
  // then skips (their terms come from the other ranks).
  virtual Status moe_local_ids(int32_t* ids, int64_t n_rows, int64_t top_k, int64_t begin,
                               int64_t count);
  // The same for typed expert weights: gate_up is [n_experts * 2 * inter, hidden] and down
  // [n_experts * hidden, inter] as LinearViews (expert e's rows follow expert e - 1's); both dense
  // calls moe_experts above, otherwise moe_experts_quantized.
  Status moe_experts(const void* x, const LinearView& gate_up, const LinearView& down,
                     int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                     const float* weights, int64_t n_rows, int64_t top_k, void* out);
  virtual Status moe_experts_quantized(const void* x, const LinearView& gate_up,
                                       const LinearView& down, int64_t n_experts, int64_t hidden,
                                       int64_t inter, const int32_t* ids, const float* weights,
                                       int64_t n_rows, int64_t top_k, void* out);
  // moe_route (writing ids and weights), moe_experts on its result and, with shared_y and
  // shared_gate (both or neither), sigmoid_gated_add(out, shared_y, shared_gate): the shared
  // expert's gated output. A backend may do it in fewer launches; the results are those of the
  // separate calls.
  virtual Status moe_route_experts(const float* logits, bool norm_topk_prob, const void* x,
                                   const LinearView& gate_up, const LinearView& down,
                                   int64_t n_experts, int64_t hidden, int64_t inter, int32_t* ids,
                                   float* weights, int64_t n_rows, int64_t top_k, void* out,
                                   const void* shared_y, const float* shared_gate);
  // moe_route_experts with the shared expert's MLP run among the routed experts instead of its
  // output given: shared_gate_up [2 inter, hidden] (gate rows, then up rows) and shared_down
  // [hidden, inter], one routed expert's shapes. The result is that of shared_y = down(silu(gate)
  // * up) (linear, silu_mul, linear) followed by moe_route_experts(..., shared_y, shared_gate), up
  // to the order of the projections' sums. ids, weights: [n_rows, top_k + 1] (the routed top_k,
  // then the shared expert as expert n_experts with weight 1). Returns false, having done nothing,
  // where the backend has no such form for these arguments (the default): the caller then takes
  // the separate path.
  virtual Result<bool> moe_route_experts_shared(
      const float* /*logits*/, bool /*norm_topk_prob*/, const void* /*x*/,
      const LinearView& /*gate_up*/, const LinearView& /*down*/, int64_t /*n_experts*/,
      int64_t /*hidden*/, int64_t /*inter*/, int32_t* /*ids*/, float* /*weights*/,
      int64_t /*n_rows*/, int64_t /*top_k*/, void* /*out*/, const LinearView& /*shared_gate_up*/,
      const LinearView& /*shared_down*/, const float* /*shared_gate*/) {
    return false;
  }
  // out[r] += sigmoid(gate[r]) * y[r]. out, y: [n_rows, dim] act; gate: [n_rows] fp32
  virtual Status sigmoid_gated_add(void* out, const void* y, const void* gate, int64_t n_rows,
                                   int64_t dim);
  // PLE gate: g = signed sqrt(sum_i kn[r, s, i] qn[r, s, i] / sqrt(hidden)), out[r, s] =
  // sigmoid(g) * val[r]. kn, qn, out: [n_rows, n_streams, hidden] act; val: [n_rows, hidden] act
  virtual Status ple_gate(const void* kn, const void* qn, const void* val, int64_t n_rows,
                          int64_t n_streams, int64_t hidden, void* out);

 protected:
  friend class BackendBuffer;
  friend class HostBuffer;
  // Frees an allocation made by allocate() or upload_weight().
  virtual void release(void* data) = 0;
  // Frees an allocation made by allocate_host().
  virtual void release_host(void* data);
};

inline void BackendBuffer::reset() {
  if (backend_ != nullptr && data_ != nullptr) backend_->release(data_);
  backend_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

inline void HostBuffer::reset() {
  if (backend_ != nullptr && data_ != nullptr) backend_->release_host(data_);
  backend_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace e4kv
