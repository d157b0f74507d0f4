// The CUDA Backend: one stream, cuBLAS GEMMs with fp32 accumulation, e4kv kernels for the cache and
// attention, model_ops.cu for the small ops. Weights are converted to FP16 on the host once at
// upload (BF16 and F32 values beyond the FP16 range are load errors naming the tensor).
#include "backend/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "backend/cuda/cache_write.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/model_ops.cuh"
#include "backend/cuda/paged_attention.cuh"
#include "core/half.h"

namespace e4kv {
namespace {

#define E4KV_CUBLAS_CHECK(expr)                                                          \
  do {                                                                                   \
    const cublasStatus_t e4kv_cublas_status_ = (expr);                                   \
    if (e4kv_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                  \
      ::e4kv::detail::assert_fail(#expr, __FILE__, __LINE__,                             \
                                  std::string("cuBLAS status ") +                        \
                                      std::to_string(int(e4kv_cublas_status_)));         \
    }                                                                                    \
  } while (0)

uint16_t load_u16_le(const std::byte* p) {
  return static_cast<uint16_t>(std::to_integer<uint16_t>(p[0]) |
                               (std::to_integer<uint16_t>(p[1]) << 8));
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaBackendOptions& options)
      : device_(options.device), attention_(options.device, options.force_software_e4m3) {
    E4KV_CUDA_CHECK(cudaSetDevice(device_));
    E4KV_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    E4KV_CUBLAS_CHECK(cublasCreate(&cublas_));
    E4KV_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
    // fp32 accumulation only: no reduced-precision reductions.
    E4KV_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  }
  ~CudaBackend() override {
    cublasDestroy(cublas_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override {
    return cat("cuda:", device_, attention_.native_e4m3() ? "" : " (software E4M3 decoder)");
  }
  DType act_dtype() const override { return DType::kF16; }

  Result<BackendBuffer> allocate(size_t bytes) override {
    void* ptr = nullptr;
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
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    // Pageable source: the call returns once the bytes are staged, so the caller may reuse them.
    E4KV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    E4KV_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void fill_zero(void* dst, size_t bytes) override {
    if (bytes == 0) return;
    E4KV_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_));
  }
  void synchronize() override { E4KV_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  Result<BackendBuffer> upload_weight(const SafetensorsTensor& tensor) override {
    const int64_t n = tensor.numel();
    if (tensor.dtype != DType::kF32 && tensor.dtype != DType::kF16 &&
        tensor.dtype != DType::kBF16) {
      return Status::error(cat("tensor ", tensor.name, " has dtype ", dtype_name(tensor.dtype),
                               "; the dense runtime loads F32, F16 or BF16 weights"));
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

  Status convert(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                 int64_t n) override {
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
    return Status::error(cat("cuda convert: ", dtype_name(src_dtype), " -> ",
                             dtype_name(dst_dtype), " is not supported"));
  }

  Status cache_write(const KvCacheView& cache, const uint16_t* k, const uint16_t* v,
                     const int64_t* slot_mapping, int64_t n_tokens,
                     unsigned long long* non_finite) override {
    return cuda::cache_write(cache, k, v, slot_mapping, n_tokens, non_finite, nullptr, stream_);
  }

  Status paged_attention(const PagedAttentionParams& params,
                         const QueryBatchView& host_rows) override {
    return attention_.run(params, host_rows, stream_);
  }

 protected:
  void release(void* data) override { cudaFree(data); }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cuda::PagedAttentionRunner attention_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendOptions& options) {
  const int count = cuda::device_count();
  if (count == 0) {
    return Status::error("--device cuda: no CUDA device is visible (check the driver and "
                         "CUDA_VISIBLE_DEVICES), or use --device cpu");
  }
  if (options.device < 0 || options.device >= count) {
    return Status::error(cat("--device cuda:", options.device, ": only ", count,
                             " CUDA device(s) are visible"));
  }
  E4KV_CUDA_CHECK(cudaSetDevice(options.device));
  return std::unique_ptr<Backend>(new CudaBackend(options));
}

}  // namespace e4kv
