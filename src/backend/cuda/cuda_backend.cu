// The CUDA Backend: one stream, cuBLAS GEMMs with fp32 accumulation, e4kv kernels for the cache and
// attention, model_ops.cu for the small ops. Weights are converted to FP16 on the host once at
// upload (BF16 and F32 values beyond the FP16 range are load errors naming the tensor).
#include "backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/cuda/block_copy.cuh"
#include "backend/cuda/cache_write.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/gated_delta_rule.cuh"
#include "backend/cuda/hc_mix_fused.cuh"
#include "backend/cuda/hybrid_ops.cuh"
#include "backend/cuda/model_ops.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/paged_attention.cuh"
#include "backend/cuda/profile_spin.cuh"
#include "backend/cuda/qsa_index_scores.cuh"
#include "backend/cuda/qsa_indexer_write.cuh"
#include "backend/cuda/qsa_topk.cuh"
#include "backend/cuda/quant_linear.cuh"
#include "backend/cuda/quant_moe.cuh"
#include "backend/cuda/quant_w4_mma.cuh"
#include "backend/cuda/sampling.cuh"
#include "core/half.h"
#include "core/norm_rope.h"

namespace e4kv {
namespace {

#define E4KV_CUBLAS_CHECK(expr)                                                      \
  do {                                                                               \
    const cublasStatus_t e4kv_cublas_status_ = (expr);                               \
    if (e4kv_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                              \
      ::e4kv::detail::assert_fail(                                                   \
          #expr, __FILE__, __LINE__,                                                 \
          std::string("cuBLAS status ") + std::to_string(int(e4kv_cublas_status_))); \
    }                                                                                \
  } while (0)

uint16_t load_u16_le(const std::byte* p) {
  return static_cast<uint16_t>(std::to_integer<uint16_t>(p[0]) |
                               (std::to_integer<uint16_t>(p[1]) << 8));
}

// The fused statistics of the CUDA cache write (cache_write.cuh), accumulated on the device and
// read back on request.
class DeviceKvWriteStats final : public KvWriteStats {
 public:
  explicit DeviceKvWriteStats(cudaStream_t stream) : stream_(stream) {}
  std::pair<KvTensorStats, KvTensorStats> read() override { return buffer.read(stream_); }
  void reset() override { buffer.reset(stream_); }

  cuda::CacheWriteStatsBuffer buffer;

 private:
  cudaStream_t stream_;
};

// Also the step profiler of its stream (backend/profiler.h): CUDA events around each section.
class CudaGraphExec final : public BackendGraph {
 public:
  CudaGraphExec(cudaGraph_t graph, cudaGraphExec_t exec, cudaStream_t stream)
      : graph_(graph), exec_(exec), stream_(stream) {}
  ~CudaGraphExec() override {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  Status replay() override {
    const cudaError_t err = cudaGraphLaunch(exec_, stream_);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::error(cat("cuda graph: launch failed (", cudaGetErrorString(err), ")"));
    }
    return ok_status();
  }
  int64_t n_nodes() const override {
    size_t n = 0;
    if (cudaGraphGetNodes(graph_, nullptr, &n) != cudaSuccess) {
      (void)cudaGetLastError();
      return -1;
    }
    return int64_t(n);
  }

 private:
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

class CudaBackend final : public Backend, public StepProfiler {
 public:
  explicit CudaBackend(const CudaBackendOptions& options)
      : device_(options.device),
        attention_(options.device, options.force_software_e4m3),
        hc_mix_kernels_(options.hc_mix_warp_per_slice ? cuda::HcMixKernels::kWarpPerSlice
                                                      : cuda::HcMixKernels::kLoadFirst),
        shared_in_experts_(options.moe_shared_expert_fused) {
    E4KV_CUDA_CHECK(cudaSetDevice(device_));
    E4KV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    E4KV_CUBLAS_CHECK(cublasCreate(&cublas_));
    E4KV_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
    // fp32 accumulation only: no reduced-precision reductions.
    E4KV_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
    // cuBLAS's workspace, owned here and fixed for the backend's life (set after the stream,
    // which resets it): a GEMM never allocates, eagerly or in a CUDA graph, and a graph's GEMMs
    // run exactly as the eager ones.
    E4KV_CUDA_CHECK(cudaMalloc(&cublas_workspace_, kCublasWorkspaceBytes));
    E4KV_CUBLAS_CHECK(cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes));
  }
  ~CudaBackend() override {
    for (cudaEvent_t event : profile_events_) cudaEventDestroy(event);
    cudaFree(scores_);
    cudaFree(moe_workspace_);
    cudaFree(dequant_scratch_);
    cudaFree(rope_table_);
    cublasDestroy(cublas_);
    cudaFree(cublas_workspace_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override {
    return cat("cuda:", device_, attention_.native_e4m3() ? "" : " (software E4M3 decoder)");
  }
  DType act_dtype() const override { return DType::kF16; }

  Result<DeviceMemoryInfo> device_memory() const override {
    DeviceMemoryInfo info;
    size_t free_bytes = 0, total_bytes = 0;
    cudaDeviceProp prop{};
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) err = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device_);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::error(
          cat("cuda:", device_, ": cannot query device memory (", cudaGetErrorString(err), ")"));
    }
    info.free_bytes = static_cast<int64_t>(free_bytes);
    info.total_bytes = static_cast<int64_t>(total_bytes);
    info.device_name = prop.name;
    return info;
  }

  Result<BackendBuffer> allocate(size_t bytes) override {
    void* ptr = nullptr;
    ++counters_.allocations;
    const cudaError_t err = cudaMalloc(&ptr, std::max<size_t>(bytes, 1));
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free allocation error
      return Status::error(cat("cuda:", device_, ": cannot allocate ", bytes,
                               " bytes of GPU memory (", cudaGetErrorString(err),
                               "); lower --max-model-len or use a smaller model"));
    }
    E4KV_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream_));
    return BackendBuffer(this, ptr, bytes);
  }
  Result<HostBuffer> allocate_host(size_t bytes) override {
    void* ptr = nullptr;
    ++counters_.allocations;
    const cudaError_t err = cudaMallocHost(&ptr, std::max<size_t>(bytes, 1));
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status::error(cat("cuda:", device_, ": cannot allocate ", bytes,
                               " bytes of page-locked host memory (", cudaGetErrorString(err),
                               ")"));
    }
    std::memset(ptr, 0, std::max<size_t>(bytes, 1));
    return HostBuffer(this, ptr, bytes);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    // Pageable source: the call returns once the bytes are staged, so the caller may reuse them.
    E4KV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    E4KV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    ++counters_.host_waits;
    E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void fill_zero(void* dst, size_t bytes) override {
    if (bytes == 0) return;
    E4KV_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_));
  }
  Status copy_blocks(void* pool, int64_t n_blocks, size_t block_bytes,
                     std::span<const BlockCopy> copies) override {
    E4KV_RETURN_IF_ERROR(validate_block_copies(n_blocks, copies));
    cuda::copy_blocks(pool, block_bytes, copies, stream_);
    return ok_status();
  }
  void synchronize() override {
    ++counters_.host_waits;
    E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void begin(bool isolate) override {
    profiling_ = true;
    profile_isolate_ = isolate;
    profile_marks_.clear();
    profile_events_used_ = 0;
  }
  void mark(const char* section) override {
    if (!profiling_) return;
    close_profile_section();
    if (profile_isolate_) {
      // The previous section drains first, so the hold below is never behind queued work and the
      // host issues this section into an empty queue (no back-pressure in host_ms).
      E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_));
      cuda::profile_spin(kIsolateMicros, stream_);
    }
    ProfileMark opened;
    opened.section = section;
    opened.start = profile_event();
    E4KV_CUDA_CHECK(cudaEventRecord(opened.start, stream_));
    opened.host_start = std::chrono::steady_clock::now();
    profile_marks_.push_back(opened);
  }
  std::vector<ProfileSection> end() override {
    if (!profiling_) return {};
    close_profile_section();
    profiling_ = false;
    E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<ProfileSection> sections;
    for (const ProfileMark& closed : profile_marks_) {
      float ms = 0;
      E4KV_CUDA_CHECK(cudaEventElapsedTime(&ms, closed.start, closed.end));
      add_profile_section(
          sections, closed.section,
          std::chrono::duration<double, std::milli>(closed.host_end - closed.host_start).count(),
          double(ms));
    }
    return sections;
  }

  Result<BackendBuffer> upload_weight(const SafetensorsTensor& tensor) override {
    const int64_t n = tensor.numel();
    if (tensor.dtype != DType::kF32 && tensor.dtype != DType::kF16 &&
        tensor.dtype != DType::kBF16) {
      return Status::error(cat("tensor ", tensor.name, " has dtype ", dtype_name(tensor.dtype),
                               "; the dense runtime loads F32, F16 or BF16 weights"));
    }
    if (tensor.dtype == DType::kF16 && std::endian::native == std::endian::little) {
      // Already the device's format: straight from the checkpoint's mapping (a pageable copy the
      // driver stages; no host conversion pass over what are often tens of GB).
      E4KV_ASSIGN_OR_RETURN(BackendBuffer buffer, allocate(size_t(n) * sizeof(uint16_t)));
      copy_from_host(buffer.data(), tensor.bytes.data(), size_t(n) * sizeof(uint16_t));
      Result<BackendBuffer> result(std::move(buffer));
      return result;
    }
    std::vector<uint16_t> host(static_cast<size_t>(n));
    const std::byte* in = tensor.bytes.data();
    for (int64_t i = 0; i < n; ++i) {
      float x;
      if (tensor.dtype == DType::kF16) {
        host[i] = load_u16_le(in + 2 * i);
        continue;
      } else if (tensor.dtype == DType::kBF16) {
        x = bf16_to_f32(load_u16_le(in + 2 * i));
      } else {
        std::memcpy(&x, in + 4 * i, 4);
      }
      const uint16_t h = f32_to_f16(x);
      if (std::isfinite(x) && !std::isfinite(f16_to_f32(h))) {
        return Status::error(cat("tensor ", tensor.name, " element ", i, " = ", x,
                                 " is beyond the FP16 range (|x| <= 65504) the CUDA backend "
                                 "computes in; this checkpoint cannot run in FP16"));
      }
      host[i] = h;
    }
    E4KV_ASSIGN_OR_RETURN(BackendBuffer buffer, allocate(host.size() * sizeof(uint16_t)));
    E4KV_CUDA_CHECK(cudaMemcpyAsync(buffer.data(), host.data(), host.size() * sizeof(uint16_t),
                                    cudaMemcpyHostToDevice, stream_));
    E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `host` dies here
    // nvcc's front end does not move a local into a different return type implicitly.
    Result<BackendBuffer> result(std::move(buffer));
    return result;
  }

  Status gather_rows(const void* table, const int32_t* index, int64_t n, int64_t dim,
                     void* out) override {
    cuda::gather_rows_f16(static_cast<const uint16_t*>(table), index, n, dim,
                          static_cast<uint16_t*>(out), stream_);
    return ok_status();
  }

  Status rms_norm(const void* x, const void* weight, int64_t n_rows, int64_t dim, float eps,
                  RmsNormForm form, void* out) override {
    cuda::rms_norm_f16(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(weight),
                       n_rows, dim, eps, form, static_cast<uint16_t*>(out), stream_);
    return ok_status();
  }

  using Backend::linear;
  using Backend::moe_experts;

  Status linear(const void* x, const void* w, const void* bias, int64_t n, int64_t in, int64_t out,
                void* y, DType y_dtype) override {
    if (y_dtype != DType::kF16 && y_dtype != DType::kF32) {
      return Status::error("cuda linear: the output must be F16 or F32");
    }
    if (n == 0) return ok_status();
    const bool y_f32 = y_dtype == DType::kF32;
    float beta = 0.0f;
    if (bias != nullptr) {
      // The bias joins the fp32 accumulation (beta = 1) before the single rounding to FP16.
      cuda::broadcast_bias(static_cast<const uint16_t*>(bias), n, out, y, y_f32, stream_);
      beta = 1.0f;
    }
    const float alpha = 1.0f;
    // Column-major view: Y^T [out, n] = W [out, in] (stored as W^T column-major) * X^T [in, n].
    E4KV_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(out), int(n), int(in),
                                   &alpha, w, CUDA_R_16F, int(in), x, CUDA_R_16F, int(in), &beta, y,
                                   y_f32 ? CUDA_R_32F : CUDA_R_16F, int(out), CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    return ok_status();
  }

  // Quantized weights (quant_linear.cuh, quant_moe.cuh): dequantized in registers, no workspace
  // for the linear, the MoE workspace for the experts.
  bool runs_weight_format(WeightFormat format) const override {
    return format == WeightFormat::kDense || format == WeightFormat::kW4 ||
           format == WeightFormat::kNvfp4 || format == WeightFormat::kFp8Block;
  }
  Status linear_quantized(const void* x, const LinearView& w, const void* bias, int64_t n, void* y,
                          DType y_dtype) override {
    if (y_dtype != DType::kF16 && y_dtype != DType::kF32) {
      return Status::error("cuda linear: the output must be F16 or F32");
    }
    if (w.dense()) return linear(x, w.data, bias, n, w.in, w.out, y, y_dtype);
    const bool w4_mma =
        n < cuda::kW4MmaMaxRows && cuda::w4_mma_auto() && cuda::w4_mma_supported(w, x);
    if (n >= cuda::kQuantDequantMinRows && !w4_mma && dequant_scratch_ready()) {
      return linear_dequantized(x, w, bias, n, y, y_dtype);
    }
    return cuda::quant_linear(h(x), w, h(bias), n, y, y_dtype == DType::kF32, stream_);
  }

  // The scratch of linear_dequantized: allocated on first use outside a capture when the
  // workspaces may grow (a memory-profiling forward at the largest step does it, so the pool
  // budget accounts for it); without it the quantized kernels run instead.
  bool dequant_scratch_ready() {
    if (dequant_scratch_ != nullptr) return true;
    if (capturing_ || !workspace_growth_) return false;
    return ensure(&dequant_scratch_, &dequant_scratch_bytes_, kDequantScratchBytes,
                  "dequantization")
        .ok();
  }

  // y = x dequant(w)^T + bias as slices of output rows: each slice dequantized to FP16 into the
  // scratch, then one cuBLAS GEMM into its columns of y (ldc = out).
  Status linear_dequantized(const void* x, const LinearView& w, const void* bias, int64_t n,
                            void* y, DType y_dtype) {
    if (w.in * 2 > int64_t(dequant_scratch_bytes_)) {
      return cuda::quant_linear(h(x), w, h(bias), n, y, y_dtype == DType::kF32, stream_);
    }
    const bool y_f32 = y_dtype == DType::kF32;
    float beta = 0.0f;
    if (bias != nullptr) {
      cuda::broadcast_bias(static_cast<const uint16_t*>(bias), n, w.out, y, y_f32, stream_);
      beta = 1.0f;
    }
    const float alpha = 1.0f;
    const int64_t slice = std::max<int64_t>(1, int64_t(dequant_scratch_bytes_) / (w.in * 2));
    const size_t y_elem = y_f32 ? 4 : 2;
    for (int64_t o0 = 0; o0 < w.out; o0 += slice) {
      const int64_t rows = std::min(slice, w.out - o0);
      E4KV_RETURN_IF_ERROR(cuda::quant_dequantize_rows(
          w, o0, rows, static_cast<uint16_t*>(dequant_scratch_), stream_));
      void* y_slice = static_cast<unsigned char*>(y) + size_t(o0) * y_elem;
      E4KV_CUBLAS_CHECK(cublasGemmEx(
          cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(rows), int(n), int(w.in), &alpha, dequant_scratch_,
          CUDA_R_16F, int(w.in), x, CUDA_R_16F, int(w.in), &beta, y_slice,
          y_f32 ? CUDA_R_32F : CUDA_R_16F, int(w.out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    return ok_status();
  }

  Status rope_neox(void* x, const float* cos, const float* sin, int64_t n_rows, int64_t n_heads,
                   int64_t head_dim, int64_t rotary_dim) override {
    cuda::rope_neox_f16(static_cast<uint16_t*>(x), cos, sin, n_rows, n_heads, head_dim, rotary_dim,
                        stream_);
    return ok_status();
  }

  Status silu_mul(const void* gate, const void* up, void* out, int64_t n) override {
    cuda::silu_mul_f16(static_cast<const uint16_t*>(gate), static_cast<const uint16_t*>(up),
                       static_cast<uint16_t*>(out), n, stream_);
    return ok_status();
  }

  Status add(void* x, const void* y, int64_t n) override {
    cuda::add_f16(static_cast<uint16_t*>(x), static_cast<const uint16_t*>(y), n, stream_);
    return ok_status();
  }

  Status add_rms_norm(void* x, const void* y, const void* weight, int64_t n_rows, int64_t dim,
                      float eps, RmsNormForm form, void* out) override {
    cuda::add_rms_norm_f16(static_cast<uint16_t*>(x), static_cast<const uint16_t*>(y),
                           static_cast<const uint16_t*>(weight), n_rows, dim, eps, form,
                           static_cast<uint16_t*>(out), stream_);
    return ok_status();
  }

  Status convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n) override {
    if (src_dtype == dst_dtype) {
      if (n > 0) {
        E4KV_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n) * dtype_size(src_dtype),
                                        cudaMemcpyDeviceToDevice, stream_));
      }
      return ok_status();
    }
    if (src_dtype == DType::kF32 && dst_dtype == DType::kF16) {
      cuda::f32_to_f16(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n, stream_);
      return ok_status();
    }
    return Status::error(cat("cuda convert: ", dtype_name(src_dtype), " -> ", dtype_name(dst_dtype),
                             " is not supported"));
  }

  Status cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                     const int64_t* slot_mapping, int64_t n_tokens, unsigned long long* non_finite,
                     KvWriteStats* stats) override {
    const cuda::CacheWriteStatsView view =
        stats != nullptr ? static_cast<DeviceKvWriteStats&>(*stats).buffer.view()
                         : cuda::CacheWriteStatsView{};
    return cuda::cache_write(cache, k, v, slot_mapping, n_tokens, non_finite,
                             stats != nullptr ? &view : nullptr, stream_);
  }
  Result<std::unique_ptr<KvWriteStats>> make_kv_write_stats() override {
    return std::unique_ptr<KvWriteStats>(std::make_unique<DeviceKvWriteStats>(stream_));
  }

  Status reserve_attention(std::span<const AttentionLayerShape> shapes, int64_t max_rows,
                           int64_t max_seq_tokens) override {
    ++counters_.allocations;
    return attention_.reserve(shapes, max_rows, max_seq_tokens, stream_);
  }
  Status plan_attention(const QueryBatchView& host_rows) override {
    return attention_.plan(host_rows, stream_);
  }
  Status paged_attention(const PagedAttentionParams& params) override {
    return attention_.run(params, stream_);
  }

  // ---- hybrid-model ops ----
  bool has_hybrid_ops() const override { return true; }

  Status rms_norm_grouped(const void* x, const void* weight, int64_t n_rows, int64_t n_groups,
                          int64_t dim, float eps, RmsNormForm form, void* out) override {
    cuda::rms_norm_grouped_f16(h(x), h(weight), n_rows, n_groups, dim, eps, form, h(out), stream_);
    return ok_status();
  }
  Result<bool> hc_mix_fused(void* x, const void* norm_weight, const void* down, const void* up,
                            const void* inject, int64_t n_rows, int64_t streams, int64_t hidden,
                            int64_t rank, float eps, void* mix, void* inj, void* scratch,
                            size_t scratch_bytes, const void* pending_y,
                            const void* pending_inj) override {
    if (!cuda::hc_mix_fused_supported(n_rows, streams, hidden, rank) ||
        scratch_bytes < cuda::hc_mix_fused_scratch_bytes(n_rows, streams, rank)) {
      return false;
    }
    if ((pending_y == nullptr) != (pending_inj == nullptr)) return false;
    for (const void* p :
         {static_cast<const void*>(x), norm_weight, down, up, inject, static_cast<const void*>(mix),
          static_cast<const void*>(inj), static_cast<const void*>(scratch), pending_y}) {
      if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    }
    cuda::hc_mix_fused_f16(h(x), h(norm_weight), h(down), h(up), h(inject), n_rows, streams, hidden,
                           rank, eps, h(mix), h(inj), scratch, h(pending_y), h(pending_inj),
                           stream_, hc_mix_kernels_);
    return true;
  }
  Status silu_scaled(const void* x, int64_t n, float scale, void* out) override {
    cuda::silu_scaled_f16(h(x), n, scale, h(out), stream_);
    return ok_status();
  }
  Status hc_mix(const void* up, const void* xn, int64_t n_rows, int64_t n_streams, int64_t hidden,
                void* mix) override {
    cuda::hc_mix_f16(h(up), h(xn), n_rows, n_streams, hidden, h(mix), stream_);
    return ok_status();
  }
  Status hc_inject(void* x, const void* y, const void* inj, int64_t n_rows, int64_t n_streams,
                   int64_t hidden) override {
    cuda::hc_inject_f16(h(x), h(y), h(inj), n_rows, n_streams, hidden, stream_);
    return ok_status();
  }
  Status hc_expand(const void* e, int64_t n_rows, int64_t n_streams, int64_t hidden,
                   void* x) override {
    cuda::hc_expand_f16(h(e), n_rows, n_streams, hidden, h(x), stream_);
    return ok_status();
  }
  Status conv1d_silu(const void* x, int64_t channels, const void* weight, int64_t kernel,
                     int64_t dilation, void* states, const SequenceRowsView& seqs,
                     void* out) override {
    if (!cuda::conv1d_silu_f16_supported(kernel, dilation)) {
      return Status::error(
          cat("cuda backend: a causal conv of kernel ", kernel, " and dilation ", dilation,
              " is outside the kernel's limits (kernel <= ", cuda::kConv1dMaxKernel,
              ", (kernel - 1) * dilation <= ", cuda::kConv1dMaxState, ")"));
    }
    cuda::conv1d_silu_f16(h(x), channels, h(weight), kernel, dilation, h(states), seqs, h(out),
                          stream_);
    return ok_status();
  }
  Status gated_delta_gates(const void* a, const void* b, const void* a_log, const void* dt_bias,
                           int64_t n_rows, int64_t n_heads, float* g, float* beta) override {
    cuda::gated_delta_gates_f16(h(a), h(b), h(a_log), h(dt_bias), n_rows, n_heads, g, beta,
                                stream_);
    return ok_status();
  }
  Status gated_delta_rule(const void* qkv, const float* g, const float* beta, int64_t n_k_heads,
                          int64_t n_v_heads, int64_t head_k_dim, int64_t head_v_dim, float* states,
                          const SequenceRowsView& seqs, void* out) override {
    return cuda::gated_delta_rule_f16(h(qkv), g, beta, n_k_heads, n_v_heads, head_k_dim, head_v_dim,
                                      states, seqs, h(out), stream_);
  }
  Result<bool> gated_delta_rule_raw_gates(const void* qkv, const void* a, const void* b,
                                          const void* a_log, const void* dt_bias, int64_t n_k_heads,
                                          int64_t n_v_heads, int64_t head_k_dim, int64_t head_v_dim,
                                          float* states, const SequenceRowsView& seqs,
                                          void* out) override {
    E4KV_RETURN_IF_ERROR(cuda::gated_delta_rule_raw_gates_f16(
        h(qkv), h(a), h(b), h(a_log), h(dt_bias), n_k_heads, n_v_heads, head_k_dim, head_v_dim,
        states, seqs, h(out), stream_));
    return true;
  }
  Status gated_rms_norm(const void* x, const void* z, const void* weight, int64_t n_rows,
                        int64_t dim, float eps, bool sigmoid_gate, void* out) override {
    cuda::gated_rms_norm_f16(h(x), h(z), h(weight), n_rows, dim, eps, sigmoid_gate, h(out),
                             stream_);
    return ok_status();
  }
  Status sample_rows(const float* logits, int64_t vocab, const SampleRowParams* params, int64_t n,
                     int32_t* tokens, int32_t* non_finite) override {
    if (vocab < 1 || vocab >= (int64_t(1) << 31) || n < 0 || n >= (int64_t(1) << 31)) {
      return Status::error(cat("cuda sample_rows: unsupported shape vocab=", vocab, " n=", n));
    }
    cuda::sample_rows_f32(logits, vocab, params, n, tokens, non_finite, stream_);
    return ok_status();
  }

  Status moe_route(const float* logits, int64_t n_rows, int64_t n_experts, int64_t top_k,
                   bool norm_topk_prob, int32_t* ids, float* weights) override {
    return cuda::moe_route_f32(logits, n_rows, n_experts, top_k, norm_topk_prob, ids, weights,
                               stream_);
  }
  Status moe_experts(const void* x, const void* gate_up, const void* down, int64_t n_experts,
                     int64_t hidden, int64_t inter, const int32_t* ids, const float* weights,
                     int64_t n_rows, int64_t top_k, void* out) override {
    // Passes of up to kMoeRowsPerPass rows: the workspace is sized once for them.
    const size_t bytes = cuda::moe_experts_workspace_bytes(
        std::min<int64_t>(n_rows, kMoeRowsPerPass), top_k, n_experts, hidden, inter);
    E4KV_RETURN_IF_ERROR(ensure(&moe_workspace_, &moe_workspace_bytes_, bytes, "MoE"));
    return cuda::moe_experts_f16(h(x), h(gate_up), h(down), n_experts, hidden, inter, ids, weights,
                                 n_rows, top_k, h(out), moe_workspace_, moe_workspace_bytes_,
                                 stream_);
  }
  Status moe_route_experts(const float* logits, bool norm_topk_prob, const void* x,
                           const LinearView& gate_up, const LinearView& down, int64_t n_experts,
                           int64_t hidden, int64_t inter, int32_t* ids, float* weights,
                           int64_t n_rows, int64_t top_k, void* out, const void* shared_y,
                           const float* shared_gate) override {
    if (gate_up.format != WeightFormat::kDense || down.format != WeightFormat::kDense) {
      return Backend::moe_route_experts(logits, norm_topk_prob, x, gate_up, down, n_experts, hidden,
                                        inter, ids, weights, n_rows, top_k, out, shared_y,
                                        shared_gate);
    }
    E4KV_ASSERT(gate_up.out == n_experts * 2 * inter && gate_up.in == hidden &&
                    down.out == n_experts * hidden && down.in == inter,
                "moe_route_experts: the expert weights do not have the stated shape");
    const size_t bytes = cuda::moe_experts_workspace_bytes(
        std::min<int64_t>(n_rows, kMoeRowsPerPass), top_k, n_experts, hidden, inter);
    E4KV_RETURN_IF_ERROR(ensure(&moe_workspace_, &moe_workspace_bytes_, bytes, "MoE"));
    return cuda::moe_route_experts_f16(logits, norm_topk_prob, h(x), h(gate_up.data), h(down.data),
                                       n_experts, hidden, inter, ids, weights, n_rows, top_k,
                                       h(out), h(shared_y), shared_gate, moe_workspace_,
                                       moe_workspace_bytes_, stream_);
  }
  Result<bool> moe_route_experts_shared(const float* logits, bool norm_topk_prob, const void* x,
                                        const LinearView& gate_up, const LinearView& down,
                                        int64_t n_experts, int64_t hidden, int64_t inter,
                                        int32_t* ids, float* weights, int64_t n_rows, int64_t top_k,
                                        void* out, const LinearView& shared_gate_up,
                                        const LinearView& shared_down,
                                        const float* shared_gate) override {
    const auto fp16 = [](const LinearView& w) {
      return w.format == WeightFormat::kDense && w.act_size == 2 &&
             reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
    };
    if (!shared_in_experts_ || n_rows < 1 || n_rows > cuda::kMoeSharedInExpertsMaxRows ||
        n_experts + 1 > cuda::kMoeMaxExperts || top_k + 1 > cuda::kMoeMaxTopK || !fp16(gate_up) ||
        !fp16(down) || !fp16(shared_gate_up) || !fp16(shared_down) ||
        shared_gate_up.out != 2 * inter || shared_gate_up.in != hidden ||
        shared_down.out != hidden || shared_down.in != inter) {
      return false;
    }
    E4KV_ASSERT(gate_up.out == n_experts * 2 * inter && gate_up.in == hidden &&
                    down.out == n_experts * hidden && down.in == inter,
                "moe_route_experts_shared: the expert weights do not have the stated shape");
    const size_t bytes =
        cuda::moe_experts_workspace_bytes(n_rows, top_k + 1, n_experts + 1, hidden, inter);
    if (bytes > moe_workspace_bytes_ &&
        !ensure(&moe_workspace_, &moe_workspace_bytes_, bytes, "MoE").ok()) {
      return false;
    }
    E4KV_RETURN_IF_ERROR(cuda::moe_route_experts_shared_f16(
        logits, norm_topk_prob, h(x), h(gate_up.data), h(down.data), n_experts, hidden, inter, ids,
        weights, n_rows, top_k, h(out), h(shared_gate_up.data), h(shared_down.data), shared_gate,
        moe_workspace_, moe_workspace_bytes_, stream_));
    return true;
  }
  Status moe_experts_quantized(const void* x, const LinearView& gate_up, const LinearView& down,
                               int64_t n_experts, int64_t hidden, int64_t inter, const int32_t* ids,
                               const float* weights, int64_t n_rows, int64_t top_k,
                               void* out) override {
    const size_t bytes = cuda::quant_moe_workspace_bytes(std::min<int64_t>(n_rows, kMoeRowsPerPass),
                                                         top_k, n_experts, hidden, inter);
    E4KV_RETURN_IF_ERROR(ensure(&moe_workspace_, &moe_workspace_bytes_, bytes, "MoE"));
    return cuda::quant_moe_experts(h(x), gate_up, down, n_experts, hidden, inter, ids, weights,
                                   n_rows, top_k, h(out), moe_workspace_, moe_workspace_bytes_,
                                   stream_);
  }
  Status sigmoid_gated_add(void* out, const void* y, const void* gate, int64_t n_rows,
                           int64_t dim) override {
    cuda::sigmoid_gated_add_f16(h(out), h(y), static_cast<const float*>(gate), n_rows, dim,
                                stream_);
    return ok_status();
  }
  Status ple_gate(const void* kn, const void* qn, const void* val, int64_t n_rows,
                  int64_t n_streams, int64_t hidden, void* out) override {
    cuda::ple_gate_f16(h(kn), h(qn), h(val), n_rows, n_streams, hidden, h(out), stream_);
    return ok_status();
  }
  Status qsa_indexer_write(const IndexerCompressedView& compressed, const IndexerRingView& rings,
                           const uint16_t* index_k, const SequenceRowsView& seqs,
                           const BlockTableView& block_table,
                           const IndexerKeyNormRope& norm_rope) override {
    const int64_t max_tokens = seqs.max_seq_rows;
    if (max_tokens == 0) return ok_status();
    E4KV_RETURN_IF_ERROR(
        ensure_rope_table(norm_rope.inv_freq, norm_rope.rotary_dim, seqs.max_end_pos));
    cuda::QsaIndexerWriteArgs args;
    args.compressed = compressed;
    args.rings = rings;
    args.batch.index_k = index_k;
    args.batch.token_offsets = seqs.row_begin;
    args.batch.start_pos = seqs.start_pos;
    args.batch.ring_index = seqs.state_slot;
    args.batch.n_seqs = seqs.n_seqs;
    args.batch.block_tables = block_table;
    args.norm_weight = norm_rope.norm_weight;
    args.eps = norm_rope.eps;
    args.rotary_dim = norm_rope.rotary_dim;
    args.rope_table = rope_table_;
    args.n_rope_positions = rope_positions_;
    args.max_tokens_per_seq = max_tokens;
    return cuda::qsa_indexer_write(args, stream_);
  }

  Status qsa_select(const QsaSelectionConfig& config, const IndexerCompressedView& compressed,
                    const BlockTableView& block_table, const QueryBatchView& rows,
                    const uint16_t* index_q, int32_t* sel_tokens, int32_t* sel_counts) override {
    if (rows.n_rows == 0) return ok_status();
    // Every row's visible groups lie within its block-table row. Rows are scored in chunks whose
    // scores fit kScoreWorkspaceBytes (a long prefill chunk at a long context would need GBs).
    const int64_t max_groups =
        std::max<int64_t>(1, block_table.max_blocks_per_seq * compressed.rows_per_block());
    const int64_t chunk = score_rows_per_chunk(max_groups);
    const int64_t width = qsa_selection_width(config.budget, compressed.ratio);
    const int64_t q_elems = config.n_index_heads * compressed.index_dim;
    for (int64_t r0 = 0; r0 < rows.n_rows; r0 += chunk) {
      const int64_t n = std::min(chunk, rows.n_rows - r0);
      E4KV_RETURN_IF_ERROR(ensure(&scores_, &scores_bytes_,
                                  size_t(n) * size_t(max_groups) * sizeof(float), "QSA score"));
      QueryBatchView part = rows;
      part.n_rows = n;
      part.row_seq += r0;
      part.row_pos += r0;
      cuda::QsaIndexScoresArgs scores;
      scores.compressed = compressed;
      scores.block_table = block_table;
      scores.rows = part;
      scores.index_q = index_q + r0 * q_elems;
      scores.n_index_heads = config.n_index_heads;
      scores.max_groups = max_groups;
      scores.skip_visible_at_most = qsa_top_k(config.budget, compressed.ratio);
      scores.scores = static_cast<float*>(scores_);
      E4KV_RETURN_IF_ERROR(cuda::qsa_index_scores(scores, stream_));
      cuda::QsaTopKArgs top_k;
      top_k.rows = part;
      top_k.ratio = compressed.ratio;
      top_k.budget = config.budget;
      top_k.scores = static_cast<const float*>(scores_);
      top_k.max_groups = max_groups;
      top_k.sel_tokens = sel_tokens + r0 * width;
      top_k.sel_counts = sel_counts + r0;
      E4KV_RETURN_IF_ERROR(cuda::qsa_top_k_select(top_k, stream_));
    }
    return ok_status();
  }

  Status reserve_hybrid_workspaces(const HybridWorkspaceNeeds& needs) override {
    // Growth is what reserving is: allowed here whatever the policy.
    const bool allowed = workspace_growth_;
    workspace_growth_ = true;
    Status status = reserve_hybrid(needs);
    workspace_growth_ = allowed;
    return status;
  }
  void allow_workspace_growth(bool allowed) override { workspace_growth_ = allowed; }

  CudaBackendCounters counters() const { return counters_; }
  uint64_t attention_plan_signature() const { return attention_.plan_signature(); }
  uint64_t launch_signature() const override { return attention_.plan_signature(); }
  bool supports_graphs() const override { return true; }
  Result<std::unique_ptr<BackendGraph>> capture_graph(
      const std::function<Status()>& issue) override {
    cudaError_t err = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::error(
          cat("cuda graph: cannot begin the capture (", cudaGetErrorString(err), ")"));
    }
    capturing_ = true;
    Status issued = issue();
    capturing_ = false;
    cudaGraph_t graph = nullptr;
    err = cudaStreamEndCapture(stream_, &graph);
    if (!issued.ok()) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      return issued;
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return Status::error(cat("cuda graph: the capture was invalidated (", cudaGetErrorString(err),
                               "): an op allocated, waited for the device or copied from pageable "
                               "memory"));
    }
    cudaGraphExec_t exec = nullptr;
    err = cudaGraphInstantiate(&exec, graph, 0);
    if (err != cudaSuccess) {
      cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      return Status::error(cat("cuda graph: cannot instantiate (", cudaGetErrorString(err), ")"));
    }
    return std::unique_ptr<BackendGraph>(new CudaGraphExec(graph, exec, stream_));
  }

 private:
  Status reserve_hybrid(const HybridWorkspaceNeeds& needs) {
    if (needs.qsa_max_groups > 0) {
      const int64_t rows = std::min(needs.max_rows, score_rows_per_chunk(needs.qsa_max_groups));
      E4KV_RETURN_IF_ERROR(ensure(&scores_, &scores_bytes_,
                                  size_t(rows) * size_t(needs.qsa_max_groups) * sizeof(float),
                                  "QSA score"));
      if (needs.rope_inv_freq != nullptr) {
        E4KV_RETURN_IF_ERROR(
            ensure_rope_table(needs.rope_inv_freq, needs.rotary_dim, needs.max_positions));
      }
    }
    if (needs.moe_experts > 0) {
      // The larger of the FP16 and the quantized experts' needs (the weights' format is not
      // known here).
      const int64_t rows = std::min<int64_t>(needs.max_rows, kMoeRowsPerPass);
      const size_t bytes =
          std::max(cuda::moe_experts_workspace_bytes(rows, needs.moe_top_k, needs.moe_experts,
                                                     needs.moe_hidden, needs.moe_inter),
                   cuda::quant_moe_workspace_bytes(rows, needs.moe_top_k, needs.moe_experts,
                                                   needs.moe_hidden, needs.moe_inter));
      E4KV_RETURN_IF_ERROR(ensure(&moe_workspace_, &moe_workspace_bytes_, bytes, "MoE"));
    }
    return ok_status();
  }

 protected:
  void release(void* data) override { cudaFree(data); }
  void release_host(void* data) override { cudaFreeHost(data); }

 private:
  struct ProfileMark {
    const char* section = nullptr;
    cudaEvent_t start = nullptr;
    cudaEvent_t end = nullptr;
    std::chrono::steady_clock::time_point host_start, host_end;
  };
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  static constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;
  // linear_dequantized's slices: 8192 weight rows of 2048 (a 14336 x 4096 projection in 4).
  static constexpr size_t kDequantScratchBytes = size_t(32) << 20;
  void* dequant_scratch_ = nullptr;
  size_t dequant_scratch_bytes_ = 0;
  bool capturing_ = false;
  void* cublas_workspace_ = nullptr;
  cuda::PagedAttentionRunner attention_;
  cuda::HcMixKernels hc_mix_kernels_;
  bool shared_in_experts_;  // moe_route_experts_shared runs (CudaBackendOptions)
  bool profiling_ = false;
  bool profile_isolate_ = false;
  std::vector<ProfileMark> profile_marks_;
  std::vector<cudaEvent_t> profile_events_;
  size_t profile_events_used_ = 0;

  static constexpr size_t kScoreWorkspaceBytes = size_t(256) << 20;
  static constexpr int64_t kMoeRowsPerPass = 1024;
  static int64_t score_rows_per_chunk(int64_t max_groups) {
    return std::max<int64_t>(1, int64_t(kScoreWorkspaceBytes / (size_t(max_groups) * 4)));
  }

  cudaEvent_t profile_event() {
    if (profile_events_used_ == profile_events_.size()) {
      cudaEvent_t event = nullptr;
      E4KV_CUDA_CHECK(cudaEventCreate(&event));
      profile_events_.push_back(event);
    }
    return profile_events_[profile_events_used_++];
  }
  void close_profile_section() {
    if (profile_marks_.empty() || profile_marks_.back().end != nullptr) return;
    ProfileMark& open = profile_marks_.back();
    open.host_end = std::chrono::steady_clock::now();
    open.end = profile_event();
    E4KV_CUDA_CHECK(cudaEventRecord(open.end, stream_));
  }

  // Grows a device buffer to `bytes` (kept across calls); a growth waits for the device (a queued
  // launch may still read the buffer), so outside the reserve calls it is an error unless
  // allow_workspace_growth(true).
  Status ensure(void** buffer, size_t* capacity, size_t bytes, const char* what) {
    if (bytes <= *capacity) return ok_status();
    if (!workspace_growth_) {
      return Status::error(cat("cuda backend: the ", what, " workspace of ", *capacity,
                               " bytes is too small for ", bytes,
                               " bytes, and a forward may not grow it (it was sized at load "
                               "for the model's limits)"));
    }
    ++counters_.allocations;
    if (*buffer != nullptr) {
      ++counters_.host_waits;
      E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_));
      cudaFree(*buffer);
      *buffer = nullptr;
      *capacity = 0;
    }
    const size_t grown = std::max(bytes, 2 * *capacity);
    if (cudaMalloc(buffer, grown) != cudaSuccess) {
      (void)cudaGetLastError();
      *buffer = nullptr;
      return Status::error(cat("cuda backend: cannot allocate ", grown, " bytes of workspace"));
    }
    *capacity = grown;
    return ok_status();
  }

  // The QSA indexer's RoPE table (cos then sin per position, fp32) for positions [0, n).
  // The table is keyed by the frequencies' values, not their address: models loaded one after
  // another on this backend may get a freed model's address for different frequencies.
  Status ensure_rope_table(const double* inv_freq, int64_t rotary_dim, int64_t n) {
    const int64_t half = rotary_dim / 2;
    const bool same_freqs = rotary_dim == rope_dim_ && int64_t(rope_inv_freq_.size()) == half &&
                            std::equal(rope_inv_freq_.begin(), rope_inv_freq_.end(), inv_freq);
    if (same_freqs && n <= rope_positions_) return ok_status();
    const int64_t positions = std::max<int64_t>({n, same_freqs ? 2 * rope_positions_ : 0, 4096});
    std::vector<float> table(size_t(positions * rotary_dim));
    for (int64_t p = 0; p < positions; ++p) {
      float* row = table.data() + p * rotary_dim;
      rope_cos_sin(p, inv_freq, half, row, row + half);
    }
    size_t capacity = rope_bytes_;
    void* buffer = rope_table_;
    E4KV_RETURN_IF_ERROR(ensure(&buffer, &capacity, table.size() * sizeof(float), "RoPE table"));
    rope_table_ = static_cast<float*>(buffer);
    rope_bytes_ = capacity;
    E4KV_CUDA_CHECK(cudaMemcpyAsync(rope_table_, table.data(), table.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_));
    ++counters_.host_waits;
    E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_));
    rope_inv_freq_.assign(inv_freq, inv_freq + half);
    rope_dim_ = rotary_dim;
    rope_positions_ = positions;
    return ok_status();
  }

  static uint16_t* h(void* p) { return static_cast<uint16_t*>(p); }
  static const uint16_t* h(const void* p) { return static_cast<const uint16_t*>(p); }

  void* scores_ = nullptr;
  size_t scores_bytes_ = 0;
  void* moe_workspace_ = nullptr;
  size_t moe_workspace_bytes_ = 0;
  float* rope_table_ = nullptr;
  size_t rope_bytes_ = 0;
  std::vector<double> rope_inv_freq_;  // the table's frequencies (rotary_dim / 2)
  int64_t rope_dim_ = 0;
  int64_t rope_positions_ = 0;
  // Debug builds refuse workspace growth inside a forward; release builds grow (slower, correct).
#ifdef NDEBUG
  bool workspace_growth_ = true;
#else
  bool workspace_growth_ = false;
#endif
  CudaBackendCounters counters_;
};

}  // namespace

CudaBackendCounters cuda_backend_counters(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? cuda->counters() : CudaBackendCounters{};
}

uint64_t cuda_attention_plan_signature(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? cuda->attention_plan_signature() : 0;
}

Result<std::unique_ptr<CudaGraph>> capture_cuda_graph(Backend& backend,
                                                      const std::function<Status()>& issue) {
  if (dynamic_cast<CudaBackend*>(&backend) == nullptr) {
    return Status::error(cat(backend.name(), ": not a CUDA backend"));
  }
  return backend.capture_graph(issue);
}

Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendOptions& options) {
  const int count = cuda::device_count();
  if (count == 0) {
    return Status::error(
        "--device cuda: no CUDA device is visible (check the driver and "
        "CUDA_VISIBLE_DEVICES), or use --device cpu");
  }
  if (options.device < 0 || options.device >= count) {
    return Status::error(
        cat("--device cuda:", options.device, ": only ", count, " CUDA device(s) are visible"));
  }
  CudaBackendOptions resolved = options;
  if (const char* kernels = std::getenv("E4KV_HC_MIX_KERNELS"); kernels != nullptr) {
    const std::string_view v(kernels);
    if (v == "warp-per-slice") {
      resolved.hc_mix_warp_per_slice = true;
    } else if (v != "load-first" && !v.empty()) {
      return Status::error(
          cat("E4KV_HC_MIX_KERNELS=", v, ": expected load-first or warp-per-slice (or unset)"));
    }
  }
  if (const char* shared = std::getenv("E4KV_MOE_SHARED_EXPERT"); shared != nullptr) {
    const std::string_view v(shared);
    if (v == "fused") {
      resolved.moe_shared_expert_fused = true;
    } else if (v == "separate") {
      resolved.moe_shared_expert_fused = false;
    } else if (!v.empty()) {
      return Status::error(
          cat("E4KV_MOE_SHARED_EXPERT=", v, ": expected fused or separate (or unset)"));
    }
  }
  E4KV_CUDA_CHECK(cudaSetDevice(options.device));
  return std::unique_ptr<Backend>(new CudaBackend(resolved));
}

StepProfiler* cuda_step_profiler(Backend& backend) {
  return dynamic_cast<CudaBackend*>(&backend);
}

}  // namespace e4kv
