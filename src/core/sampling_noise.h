// The random draw of e4kv's sampler, shared by the host sampler (engine/sampler.h) and every
// backend's batched sampling op (Backend::sample_rows): the Gumbel-max draw. A request's k-th
// sampled token is
//   argmax over the kept tokens i of (logit_i / temperature + G(seed, k, i)),
//   G(seed, k, i) = -log(-log(u)), u = uniform_open(seed, k, i) in (0, 1),
// which samples exactly from softmax(logits / temperature) over the kept tokens, needs no sort and
// no running generator state (the noise of draw k is a pure function of the seed, k and the token,
// so a preempted request that recomputes draws the same tokens, and a row's draw does not depend
// on the rows beside it or on which device runs it). In fp32, with the same operations on every
// backend; CUDA's logf and the host's may differ in the last bit, which changes a draw only where
// two perturbed logits are within that rounding of each other.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define E4KV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define E4KV_HOST_DEVICE inline
#endif

namespace e4kv {

E4KV_HOST_DEVICE uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The per-draw key of draw `counter` of a request seeded `seed` (hash once per row, not per token).
E4KV_HOST_DEVICE uint64_t sampling_draw_key(uint64_t seed, uint64_t counter) {
  return splitmix64_mix(seed + 0x9e3779b97f4a7c15ull * (counter + 1));
}

// u in (0, 1) for `token` of a draw: 24 random bits, centred in their interval (never 0 or 1), so
// that fp32 holds it exactly.
E4KV_HOST_DEVICE float sampling_uniform(uint64_t draw_key, uint32_t token) {
  const uint64_t h = splitmix64_mix(draw_key ^ (0xd1b54a32d192ed03ull * (uint64_t(token) + 1)));
  return (float(uint32_t(h >> 40)) + 0.5f) * 5.9604644775390625e-08f;  // 2^-24
}

}  // namespace e4kv
