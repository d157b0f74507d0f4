// Random quantized weights (quant/linear_weight.h's canonical planes) on the host for the CUDA
// quantized-kernel tests, their device copies through a backend, and the dequantized values
// (quant/dequantize.h) the error bounds are computed from.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/half.h"
#include "core/status.h"
#include "quant/dequantize.h"
#include "quant/linear_view.h"

namespace e4kv::test {

inline constexpr double kU16 = 1.0 / 2048.0;                 // FP16 unit roundoff (2^-11)
inline constexpr double kU32 = 1.0 / 16777216.0;             // fp32 unit roundoff (2^-24)
inline constexpr double kF16HalfSpacing = 1.0 / 33554432.0;  // 2^-25: FP16 subnormal half-spacing

// xorshift64: a cheap deterministic stream (the planes are large).
class Bits {
 public:
  explicit Bits(uint64_t seed) : s_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return s_;
  }
  float uniform() { return float(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform(); }

 private:
  uint64_t s_;
};

struct HostQuantWeight {
  WeightFormat format = WeightFormat::kDense;
  int64_t out = 0;
  int64_t in = 0;
  int64_t group = 0;
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;
  std::vector<uint8_t> zeros;  // kW4 with zero points
  std::vector<float> global;   // kNvfp4

  // The view over these host planes (what the CPU backend reads).
  LinearView view() const {
    LinearView v;
    v.format = format;
    v.out = out;
    v.in = in;
    v.group = group;
    v.act_size = format == WeightFormat::kDense ? 2 : 0;
    v.data = data.data();
    v.scales = scales.empty() ? nullptr : scales.data();
    v.zeros = zeros.empty() ? nullptr : zeros.data();
    v.global = global.empty() ? nullptr : global.data();
    return v;
  }
};

// A weight [out, in] of `format` with random codes and scales: W4 scales FP16 of either sign,
// |s| in [0.002, 0.02], zeros 0..15 (or none); NVFP4 scale codes E4M3 in [0.25, 4) and global
// divisors in [50, 500); FP8 codes every finite E4M3 code, block scales in [0.001, 0.01); kDense
// FP16 in [-0.1, 0.1).
inline HostQuantWeight random_quant_weight(WeightFormat format, int64_t out, int64_t in,
                                           int64_t group, bool with_zeros, uint64_t seed) {
  Bits bits(seed);
  HostQuantWeight w;
  w.format = format;
  w.out = out;
  w.in = in;
  w.group = group;
  switch (format) {
    case WeightFormat::kW4: {
      w.data.resize(size_t(out * in / 2));
      for (uint8_t& b : w.data) b = uint8_t(bits.next() >> 56);
      const int64_t n_scales = out * (in / group);
      w.scales.resize(size_t(n_scales * 2));
      for (int64_t i = 0; i < n_scales; ++i) {
        const float magnitude = bits.uniform(0.002f, 0.02f);
        const uint16_t h = f32_to_f16((bits.next() >> 63) != 0 ? -magnitude : magnitude);
        std::memcpy(w.scales.data() + 2 * i, &h, 2);
      }
      if (with_zeros) {
        w.zeros.resize(size_t(n_scales));
        for (uint8_t& z : w.zeros) z = uint8_t(bits.next() >> 60);
      }
      break;
    }
    case WeightFormat::kNvfp4: {
      w.data.resize(size_t(out * in / 2));
      for (uint8_t& b : w.data) b = uint8_t(bits.next() >> 56);
      w.scales.resize(size_t(out * (in / group)));
      // E4M3 exponent fields 5..8 (values 2^-2 .. 2^1 * 1.875), any mantissa.
      for (uint8_t& s : w.scales) s = uint8_t(0x28 + (bits.next() >> 59));
      w.global.resize(size_t(out));
      for (float& g : w.global) g = bits.uniform(50.0f, 500.0f);
      break;
    }
    case WeightFormat::kFp8Block: {
      w.data.resize(size_t(out * in));
      for (uint8_t& b : w.data) {
        b = uint8_t(bits.next() >> 56);
        if ((b & 0x7Fu) == 0x7Fu) b = uint8_t(b - 1);  // NaN codes -> +-448
      }
      const int64_t n_groups = (in + group - 1) / group;
      w.scales.resize(size_t(out * n_groups * 4));
      for (int64_t i = 0; i < out * n_groups; ++i) {
        const float s = bits.uniform(0.001f, 0.01f);
        std::memcpy(w.scales.data() + 4 * i, &s, 4);
      }
      break;
    }
    case WeightFormat::kDense: {
      w.data.resize(size_t(out * in * 2));
      for (int64_t i = 0; i < out * in; ++i) {
        const uint16_t h = f32_to_f16(bits.uniform(-0.1f, 0.1f));
        std::memcpy(w.data.data() + 2 * i, &h, 2);
      }
      break;
    }
  }
  return w;
}

// Every element of w as fp32 [out, in] (quant/dequantize.h).
inline std::vector<float> dequantized(const HostQuantWeight& w) {
  std::vector<float> values(size_t(w.out * w.in));
  if (w.out > 0) dequantize_rows(w.view(), 0, w.out, values.data());
  return values;
}

// The planes copied into `backend`'s memory; view() points there.
struct BackendQuantWeight {
  BackendBuffer data;
  BackendBuffer scales;
  BackendBuffer zeros;
  BackendBuffer global;
  LinearView device_view;
  const LinearView& view() const { return device_view; }
};

inline Result<BackendBuffer> upload_bytes(Backend& backend, const void* src, size_t bytes) {
  E4KV_ASSIGN_OR_RETURN(BackendBuffer buffer, backend.allocate(bytes));
  backend.copy_from_host(buffer.data(), src, bytes);
  return buffer;
}

inline Result<BackendQuantWeight> upload(Backend& backend, const HostQuantWeight& w) {
  BackendQuantWeight d;
  d.device_view = w.view();
  E4KV_ASSIGN_OR_RETURN(d.data, upload_bytes(backend, w.data.data(), w.data.size()));
  d.device_view.data = d.data.data();
  if (!w.scales.empty()) {
    E4KV_ASSIGN_OR_RETURN(d.scales, upload_bytes(backend, w.scales.data(), w.scales.size()));
    d.device_view.scales = d.scales.data();
  }
  if (!w.zeros.empty()) {
    E4KV_ASSIGN_OR_RETURN(d.zeros, upload_bytes(backend, w.zeros.data(), w.zeros.size()));
    d.device_view.zeros = d.zeros.data();
  }
  if (!w.global.empty()) {
    E4KV_ASSIGN_OR_RETURN(d.global,
                          upload_bytes(backend, w.global.data(), w.global.size() * sizeof(float)));
    d.device_view.global = d.global.as<float>();
  }
  return d;
}

// FP16 values uniform in [lo, hi).
inline std::vector<uint16_t> random_f16(uint64_t seed, size_t n, float lo, float hi) {
  Bits bits(seed);
  std::vector<uint16_t> out(n);
  for (uint16_t& h : out) h = f32_to_f16(bits.uniform(lo, hi));
  return out;
}

inline std::vector<float> widen(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f16_to_f32(v[i]);
  return out;
}

}  // namespace e4kv::test
