// In-kernel timeline probes for the QSA decode step (a measuring tool, compiled in only with
// -DE4KV_TIMELINE; otherwise every macro is empty). Each kernel records %globaltimer at its entry,
// after griddepcontrol.wait and at its exit into a device buffer that the benchmark attaches, as
// minima and maxima over its CTAs (atomics spread over kTimelineSpread words per event so that a
// thousand CTAs do not queue on one address); the benchmark reduces and prints them. A kernel's
// phases (top-k) are marked by one CTA.
#pragma once

#include <cstdint>

namespace e4kv::cuda {

inline constexpr int kTimelineSpread = 32;
inline constexpr int kTimelineEvents = 8;  // per kernel
inline constexpr int kTimelineKernels = 8;
inline constexpr int kTimelinePhases = 16;  // phase marks after the kernels' events
// Event indices.
inline constexpr int kTlEntryMin = 0, kTlStartMin = 1, kTlStartMax = 2, kTlExitMin = 3,
                     kTlExitMax = 4;
// Kernel indices; the rest up to kTimelineKernels are free for kernels outside the library
// (bench/experimental/).
inline constexpr int kTlScores = 0, kTlTopK = 1, kTlDecode = 2, kTlMerge = 3;
inline constexpr int kTimelineWords =
    kTimelineKernels * kTimelineEvents * kTimelineSpread + kTimelinePhases;

#ifdef E4KV_TIMELINE
// Attach the buffer (kTimelineWords words, device memory) to each translation unit's probes.
void timeline_attach_scores(unsigned long long* buffer);
void timeline_attach_top_k(unsigned long long* buffer);
void timeline_attach_decode(unsigned long long* buffer);
#endif

}  // namespace e4kv::cuda

#if defined(E4KV_TIMELINE) && defined(__CUDACC__)
#include <cuda_runtime.h>

// Each translation unit's probe buffer (device code in the shared headers records into the buffer
// of the unit that includes it); E4KV_TIMELINE_UNIT(name) defines the unit's attach function.
namespace e4kv::cuda {
static __device__ unsigned long long* g_timeline = nullptr;
}  // namespace e4kv::cuda
#define E4KV_TIMELINE_UNIT(name)                             \
  namespace e4kv::cuda {                                     \
  void timeline_attach_##name(unsigned long long* buffer) {  \
    cudaMemcpyToSymbol(g_timeline, &buffer, sizeof(buffer)); \
  }                                                          \
  }

__device__ __forceinline__ unsigned long long e4kv_timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}
#define E4KV_TL_SLOT(kernel, event)                                                 \
  (((kernel)*e4kv::cuda::kTimelineEvents + (event)) * e4kv::cuda::kTimelineSpread + \
   (blockIdx.x + blockIdx.y) % e4kv::cuda::kTimelineSpread)
#define E4KV_TL_MIN(kernel, event)                                                         \
  do {                                                                                     \
    unsigned long long* tl_ = e4kv::cuda::g_timeline;                                      \
    if (tl_ != nullptr) atomicMin(tl_ + E4KV_TL_SLOT(kernel, event), e4kv_timeline_now()); \
  } while (0)
#define E4KV_TL_MAX(kernel, event)                                                         \
  do {                                                                                     \
    unsigned long long* tl_ = e4kv::cuda::g_timeline;                                      \
    if (tl_ != nullptr) atomicMax(tl_ + E4KV_TL_SLOT(kernel, event), e4kv_timeline_now()); \
  } while (0)
// enter_dependent_grid() with thread 0's entry and start probes around it.
#define E4KV_TL_ENTER_DEPENDENT_GRID(kernel)                            \
  do {                                                                  \
    if (threadIdx.x == 0) E4KV_TL_MIN(kernel, e4kv::cuda::kTlEntryMin); \
    enter_dependent_grid();                                             \
    if (threadIdx.x == 0) {                                             \
      E4KV_TL_MIN(kernel, e4kv::cuda::kTlStartMin);                     \
      E4KV_TL_MAX(kernel, e4kv::cuda::kTlStartMax);                     \
    }                                                                   \
  } while (0)
// The exit probes, recorded where `who` (a condition, e.g. lane == 0) holds.
#define E4KV_TL_EXIT(kernel, who)                  \
  do {                                             \
    if (who) {                                     \
      E4KV_TL_MIN(kernel, e4kv::cuda::kTlExitMin); \
      E4KV_TL_MAX(kernel, e4kv::cuda::kTlExitMax); \
    }                                              \
  } while (0)
// Phase mark i (one CTA writes it).
#define E4KV_TL_PHASE(i)                                               \
  do {                                                                 \
    unsigned long long* tl_ = e4kv::cuda::g_timeline;                  \
    if (tl_ != nullptr)                                                \
      tl_[e4kv::cuda::kTimelineKernels * e4kv::cuda::kTimelineEvents * \
              e4kv::cuda::kTimelineSpread +                            \
          (i)] = e4kv_timeline_now();                                  \
  } while (0)
#else
#define E4KV_TIMELINE_UNIT(name)
#define E4KV_TL_MIN(kernel, event) \
  do {                             \
  } while (0)
#define E4KV_TL_MAX(kernel, event) \
  do {                             \
  } while (0)
#define E4KV_TL_PHASE(i) \
  do {                   \
  } while (0)
#define E4KV_TL_ENTER_DEPENDENT_GRID(kernel) enter_dependent_grid()
#define E4KV_TL_EXIT(kernel, who) \
  do {                            \
  } while (0)
#endif
