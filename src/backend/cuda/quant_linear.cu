// Quantized linear (see quant_linear.cuh): y = x dequant(W)^T + bias with the weight dequantized
// in registers (quant_gemv.cuh gives the loads, the decoders and the lane work).
//
// One kernel per (format, token-tile height kRows in {1, 2, 4, 8}): a CTA of 8 warps takes kRows
// x rows (the smallest tile holding n, and tiles of 8 beyond) and 8 * kOutPerWarp weight rows
// (kOutPerWarp 1 for kRows <= 2, so that 1024-row projections still give 128 CTAs; 2 above, so
// that a staged x chunk serves more weight rows). The grid's x dimension is the token tiles, so
// the CTAs that read the same weight rows launch next to each other and the second read of a
// weight row hits L2. Each weight byte is read from memory once per launch for n <= 8; the
// decode case n = 1 reads 0.5 bytes per weight (W4, NVFP4) and spends about 3 ALU ops per weight
// (unpack 2, widen 1) plus one FMA per x row, so it is bandwidth-bound on every GPU of the table
// in KERNELS.md except at n >= 4 (about 2 + n ops per weight).
// note: for n >= 16 this is a CUDA-core GEMM (fp32 FMA, no tensor cores), correct and far from
// cuBLAS's FP16 speed on long prefill chunks. What a tensor-core version needs: the codes of a
// 16x16 weight block dequantized straight into the A fragments of mma.sync m16n8k16 (lane (g, t)
// holding rows g, g + 8 at k = 2t, 2t + 1, 2t + 8, 2t + 9; a k permutation inside each 16-byte
// chunk lets a lane's own 16-byte load supply its fragments, with x staged in the same order),
// (q - zero) exact in FP16, and per-group fp32 accumulators multiplied by the scale when a group
// ends (group 128 = 8 k16 steps; NVFP4's e2m1 * e4m3 is exact in FP16, so its group scale can go
// into the fragment and the 1/global at the end). On sm_70 the same A fragments feed two
// m8n8k4 (attention_common.cuh's mma_m16n8k8 fallback).
#include "backend/cuda/quant_linear.cuh"

#include <cuda_fp16.h>

#include <cstdint>
#include <limits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/quant_gemv.cuh"

namespace e4kv::cuda {
namespace {

using quant::kGemvThreads;
using quant::kGemvWarps;

struct LinearParams {
  quant::QuantWeight w;  // [out, in]
  const uint16_t* x;     // [n, in] FP16
  const uint16_t* bias;  // [out] FP16 or nullptr
  void* y;               // [n, out] FP16 or fp32
  int64_t n;
  int32_t out;
  bool y_f32;
};

// F: the lane work (quant_gemv.cuh), Format<format> or the Exact<format> fallback.
template <class F, int kRows, int kOutPerWarp>
__global__ void __launch_bounds__(kGemvThreads)
    quant_linear_kernel(const __grid_constant__ LinearParams p) {
  enter_dependent_grid();
  __shared__ __align__(16) float xs[kRows * quant::x_stage_stride<F>()];
  __shared__ const uint16_t* x_rows[kRows];
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  if (int(threadIdx.x) < kRows) {
    const int64_t row = row0 + int64_t(threadIdx.x);
    x_rows[threadIdx.x] = row < p.n ? p.x + row * p.w.in : nullptr;
  }  // read after gemv_rows' first barrier
  const int warp = int(threadIdx.x) >> 5;
  const int lane = int(threadIdx.x) & 31;
  const int64_t o0 = (int64_t(blockIdx.y) * kGemvWarps + warp) * kOutPerWarp;
  int64_t w_rows[kOutPerWarp];
#pragma unroll
  for (int o = 0; o < kOutPerWarp; ++o) w_rows[o] = o0 + o < p.out ? o0 + o : -1;
  float acc[kOutPerWarp][kRows];
  quant::gemv_rows<F, kRows, kOutPerWarp>(p.w, w_rows, x_rows, xs, acc);

  // Lane o * kRows + r writes y[row0 + r, w_rows[o]].
#pragma unroll
  for (int o = 0; o < kOutPerWarp; ++o) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (lane != o * kRows + r || w_rows[o] < 0 || row0 + r >= p.n) continue;
      float v = acc[o][r];
      if (p.bias != nullptr) v += __half2float(__ushort_as_half(p.bias[w_rows[o]]));
      const int64_t at = (row0 + r) * p.out + w_rows[o];
      if (p.y_f32) {
        static_cast<float*>(p.y)[at] = v;
      } else {
        static_cast<__half*>(p.y)[at] = __float2half_rn(v);
      }
    }
  }
}

template <class F, int kRows>
void launch_rows(const LinearParams& p, cudaStream_t stream) {
  constexpr int kOutPerWarp = kRows <= 2 ? 1 : 2;
  constexpr int64_t kOutPerCta = int64_t(kGemvWarps) * kOutPerWarp;
  const dim3 grid(unsigned((p.n + kRows - 1) / kRows),
                  unsigned((p.out + kOutPerCta - 1) / kOutPerCta));
  launch_kernel(quant_linear_kernel<F, kRows, kOutPerWarp>, LaunchDims{grid, dim3(kGemvThreads)},
                stream, p);
}

template <WeightFormat kFormat>
void launch_format(const LinearParams& p, bool fast, cudaStream_t stream) {
  using Fast = quant::Format<kFormat>;
  if (!fast) {
    // Odd shapes only (small test models): one x tile height for every n.
    if (p.n <= 1) {
      launch_rows<quant::Exact<kFormat>, 1>(p, stream);
    } else {
      launch_rows<quant::Exact<kFormat>, quant::kGemvMaxRows>(p, stream);
    }
  } else if (p.n <= 1) {
    launch_rows<Fast, 1>(p, stream);
  } else if (p.n <= 2) {
    launch_rows<Fast, 2>(p, stream);
  } else if (p.n <= 4) {
    launch_rows<Fast, 4>(p, stream);
  } else {
    launch_rows<Fast, quant::kGemvMaxRows>(p, stream);
  }
}

bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

bool quant_weight_fast_path(const LinearView& w) {
  if (w.data == nullptr || !aligned(w.data, 16)) return false;
  switch (w.format) {
    case WeightFormat::kW4:
      return w.in % 32 == 0 && w.group % 32 == 0 && aligned(w.scales, 2);
    case WeightFormat::kNvfp4:
      return w.in % 32 == 0 && w.group == 16 && aligned(w.scales, 2);
    case WeightFormat::kFp8Block:
      return w.in % 16 == 0 && w.group % 16 == 0 && aligned(w.scales, 4);
    case WeightFormat::kDense:
      return w.in % 8 == 0;
  }
  return false;
}

Status quant_weight_supported(const LinearView& w, std::string_view op) {
  const auto refuse = [&](std::string_view need) {
    return Status::error(cat(op, ": ", weight_format_name(w.format), " weight [out=", w.out,
                             ", in=", w.in, ", group=", w.group,
                             "] does not run on the CUDA kernels: ", need));
  };
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (w.out < 0 || w.out > kMaxDim || w.in < 4 || w.in > kMaxDim || w.in % 4 != 0) {
    return refuse("in must be a multiple of 4, out and in below 2^31");
  }
  if (w.data == nullptr) return refuse("no data");
  switch (w.format) {
    case WeightFormat::kW4:
    case WeightFormat::kNvfp4:
    case WeightFormat::kFp8Block:
      if (w.group < 1 || w.scales == nullptr) return refuse("group >= 1 and scales present");
      if (w.format == WeightFormat::kNvfp4 && w.global == nullptr) {
        return refuse("the global scales must be present");
      }
      if (w.format != WeightFormat::kFp8Block && w.in % w.group != 0) {
        return refuse("group must divide in");
      }
      return ok_status();
    case WeightFormat::kDense:
      if (w.act_size != 2) return refuse("FP16 elements");
      return ok_status();
  }
  return refuse("an unknown format");
}

Status quant_linear(const uint16_t* x, const LinearView& w, const uint16_t* bias, int64_t n,
                    void* y, bool y_f32, cudaStream_t stream) {
  if (w.format == WeightFormat::kDense) {
    return Status::error("cuda linear_quantized: a dense weight goes through linear (cuBLAS)");
  }
  E4KV_RETURN_IF_ERROR(quant_weight_supported(w, "cuda linear"));
  if (n < 0) return Status::error(cat("cuda linear: n=", n, " rows"));
  if (n == 0 || w.out == 0) return ok_status();
  if (x == nullptr || y == nullptr || !aligned(x, 8)) {
    return Status::error(
        cat("cuda linear: x (FP16 [", n, ", ", w.in, "]) must be 8-byte aligned, and y present"));
  }
  constexpr int64_t kMaxCtaRows = 65535;  // grid y: 8 or 16 weight rows each
  if ((w.out + 7) / 8 > kMaxCtaRows) {
    return Status::error(cat("cuda linear: out=", w.out, " exceeds ", kMaxCtaRows * 8, " rows"));
  }
  LinearParams p{};
  p.w = quant::quant_weight(w);
  p.x = x;
  p.bias = bias;
  p.y = y;
  p.n = n;
  p.out = int32_t(w.out);
  p.y_f32 = y_f32;
  const bool fast = quant_weight_fast_path(w);
  switch (w.format) {
    case WeightFormat::kW4:
      launch_format<WeightFormat::kW4>(p, fast, stream);
      break;
    case WeightFormat::kNvfp4:
      launch_format<WeightFormat::kNvfp4>(p, fast, stream);
      break;
    case WeightFormat::kFp8Block:
      launch_format<WeightFormat::kFp8Block>(p, fast, stream);
      break;
    case WeightFormat::kDense:
      break;
  }
  return ok_status();
}

}  // namespace e4kv::cuda
