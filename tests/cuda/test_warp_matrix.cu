// The warp-level matrix helpers of attention_common.cuh against their documented semantics, with
// exact arithmetic (small integers): mma_m16n8k8 and ldmatrix_x4 / ldmatrix_x4_trans. A normal
// build tests the sm_75+ instructions; a build with E4KV_VOLTA_PATH (arch.cuh) tests their Volta
// versions (two mma.m8n8k4, shuffles and plain shared loads), which every attention, index-score
// and MoE kernel then uses. The raw m8n8k4 fragment layout the Volta mma relies on is checked on
// its own, so that a wrong layout shows as itself and not as an attention error.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "cuda/device_buffer.cuh"
#include "cuda/require_gpu.h"

namespace e4kv::cuda {
namespace {

uint16_t half_bits(float v) {
  const __half h = __float2half_rn(v);
  return *reinterpret_cast<const uint16_t*>(&h);
}

__device__ uint32_t pack(uint16_t lo, uint16_t hi) {
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// m8n8k4 with both operands column-major, as mma_m16n8k8's Volta path issues it: every quad pair
// gets A[m][0] = m, A[m][1] = 1 and B[0][n] = 1, B[1][n] = 8n (k = 2, 3 zero), so D[m][n] = m + 8n
// tells where each accumulator sits. out[lane * 8 + i] = d[i].
__global__ void m8n8k4_layout_kernel(float* out) {
  const unsigned lane = threadIdx.x;
  const unsigned h = lane >> 4;
  const unsigned r = lane & 3;
  // A column r (k = r), rows 4h..4h+3.
  uint16_t a[4];
  for (int i = 0; i < 4; ++i) {
    const float m = float(i + 4 * h);
    a[i] = __half_as_ushort(__float2half_rn(r == 0 ? m : r == 1 ? 1.0f : 0.0f));
  }
  // B column n = r + 4h, k = 0..3.
  const float n = float(r + 4 * h);
  const uint16_t b0 = __half_as_ushort(__float2half_rn(1.0f));
  const uint16_t b1 = __half_as_ushort(__float2half_rn(8.0f * n));
  const uint16_t zero = __half_as_ushort(__float2half_rn(0.0f));
  float d[8] = {};
  asm volatile(
      "mma.sync.aligned.m8n8k4.col.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "r"(pack(a[0], a[1])), "r"(pack(a[2], a[3])), "r"(pack(b0, b1)), "r"(pack(zero, zero)));
  for (int i = 0; i < 8; ++i) out[lane * 8 + i] = d[i];
}

TEST(WarpMatrix, M8n8k4FragmentLayoutIsTheOneTheVoltaMmaAssumes) {
  E4KV_REQUIRE_GPU();
  DeviceBuffer<float> out(256);
  m8n8k4_layout_kernel<<<1, 32>>>(out.ptr);
  E4KV_CUDA_CHECK_LAUNCH();
  const std::vector<float> got = out.to_host();
  std::ostringstream table;
  int wrong = 0;
  for (int lane = 0; lane < 32; ++lane) {
    table << "lane " << lane << ":";
    for (int i = 0; i < 8; ++i) {
      const int row = (lane & 1) + (i & 2) + 4 * (lane >> 4);
      const int col = (i & 4) + (lane & 2) + (i & 1);
      const float v = got[lane * 8 + i];
      wrong += v != float(row + 8 * col);
      table << " (" << int(v) % 8 << "," << int(v) / 8 << ")";
    }
    table << "\n";
  }
  EXPECT_EQ(wrong, 0) << "accumulator (row, col) per lane and register:\n" << table.str();
}

// D = A B + C for a 16x8x8 problem through mma_m16n8k8, fragments per the m16n8k8 layout.
__global__ void mma16x8x8_kernel(const uint16_t* a, const uint16_t* b, const float* c, int reps,
                                 float* d) {
  const unsigned lane = threadIdx.x;
  const unsigned g = lane >> 2;
  const unsigned t = lane & 3;
  const uint32_t a0 = pack(a[g * 8 + 2 * t], a[g * 8 + 2 * t + 1]);
  const uint32_t a1 = pack(a[(g + 8) * 8 + 2 * t], a[(g + 8) * 8 + 2 * t + 1]);
  const uint32_t bf = pack(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]);  // B row-major [k][n]
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                  c[(g + 8) * 8 + 2 * t + 1]};
  for (int i = 0; i < reps; ++i) mma_m16n8k8(acc, a0, a1, bf);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

TEST(WarpMatrix, Mma16x8x8EqualsExactProducts) {
  E4KV_REQUIRE_GPU();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-8, 8);
  std::vector<float> a(128), b(64), c(128);
  for (float& v : a) v = float(small(rng));
  for (float& v : b) v = float(small(rng));
  for (float& v : c) v = float(small(rng) * 16);
  std::vector<uint16_t> ah, bh;
  for (float v : a) ah.push_back(half_bits(v));
  for (float v : b) bh.push_back(half_bits(v));
  DeviceBuffer<uint16_t> da(ah), db(bh);
  DeviceBuffer<float> dc(c), dd(128);
  for (int reps : {1, 3}) {
    mma16x8x8_kernel<<<1, 32>>>(da.ptr, db.ptr, dc.ptr, reps, dd.ptr);
    E4KV_CUDA_CHECK_LAUNCH();
    const std::vector<float> got = dd.to_host();
    int wrong = 0;
    for (int m = 0; m < 16; ++m) {
      for (int n = 0; n < 8; ++n) {
        float want = c[m * 8 + n];
        for (int r = 0; r < reps; ++r) {
          for (int k = 0; k < 8; ++k) want += a[m * 8 + k] * b[k * 8 + n];
        }
        if (got[m * 8 + n] != want && ++wrong <= 5) {
          ADD_FAILURE() << "reps " << reps << " D[" << m << "][" << n << "] = " << got[m * 8 + n]
                        << ", exact " << want;
        }
      }
    }
    EXPECT_EQ(wrong, 0) << "reps " << reps;
  }
}

// Four 8x8 matrices in shared memory with a padded row stride, row order scrambled so that the
// row addresses the lanes pass are not one linear run; r[j] per lane for both ldmatrix forms.
// Halves per shared row: 8 + 8 padding, 32 bytes (ldmatrix wants 16-byte aligned rows).
constexpr int kStride = 16;

__global__ void ldmatrix_kernel(const uint16_t* src, uint32_t* plain, uint32_t* trans) {
  __shared__ __align__(16) uint16_t tile[32 * kStride];
  const unsigned lane = threadIdx.x;
  for (int i = lane; i < 32 * kStride; i += 32) tile[i] = src[i];
  __syncwarp();
  // Lane 8j + i passes row i of matrix j, which lives at shared row (5 * (8j + i) + 3) % 32.
  const int slot = (5 * int(lane) + 3) % 32;
  uint32_t r[4];
  ldmatrix_x4(r, tile + slot * kStride);
  for (int j = 0; j < 4; ++j) plain[lane * 4 + j] = r[j];
  ldmatrix_x4_trans(r, tile + slot * kStride);
  for (int j = 0; j < 4; ++j) trans[lane * 4 + j] = r[j];
}

TEST(WarpMatrix, LdmatrixX4AndTransDeliverTheDocumentedElements) {
  E4KV_REQUIRE_GPU();
  std::vector<uint16_t> src(32 * kStride);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint16_t(0x1000 + i);
  DeviceBuffer<uint16_t> dsrc(src);
  DeviceBuffer<uint32_t> dplain(128), dtrans(128);
  ldmatrix_kernel<<<1, 32>>>(dsrc.ptr, dplain.ptr, dtrans.ptr);
  E4KV_CUDA_CHECK_LAUNCH();
  const std::vector<uint32_t> plain = dplain.to_host();
  const std::vector<uint32_t> trans = dtrans.to_host();
  auto element = [&](int j, int row, int col) {  // matrix j, as the lanes addressed it
    const int slot = (5 * (8 * j + row) + 3) % 32;
    return uint32_t(src[slot * kStride + col]);
  };
  int wrong = 0;
  for (int lane = 0; lane < 32; ++lane) {
    for (int j = 0; j < 4; ++j) {
      const int row = lane / 4;
      const int col = 2 * (lane % 4);
      const uint32_t want_plain = element(j, row, col) | element(j, row, col + 1) << 16;
      const uint32_t want_trans = element(j, col, row) | element(j, col + 1, row) << 16;
      if ((plain[lane * 4 + j] != want_plain || trans[lane * 4 + j] != want_trans) &&
          ++wrong <= 4) {
        ADD_FAILURE() << "lane " << lane << " matrix " << j << ": plain " << std::hex
                      << plain[lane * 4 + j] << " want " << want_plain << ", trans "
                      << trans[lane * 4 + j] << " want " << want_trans;
      }
    }
  }
  EXPECT_EQ(wrong, 0);
}

TEST(WarpMatrix, VoltaPathBuildDispatchesAsAV100) {
  E4KV_REQUIRE_GPU();
#if defined(E4KV_VOLTA_PATH)
  EXPECT_LE(compute_capability(0), 70);
  EXPECT_FALSE(e4m3_native_available(0));
  EXPECT_FALSE(programmatic_launch_enabled());
#else
  int major = 0;
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  EXPECT_EQ(compute_capability(0) / 10, major);
#endif
}

}  // namespace
}  // namespace e4kv::cuda
