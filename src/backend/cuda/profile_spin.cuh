// The device-side hold of the CUDA step profile (backend/profiler.h, StepProfiler::begin with
// isolate):
// one thread that spins on %globaltimer, so the ops queued behind it on the stream start back to
// back once it ends. Host-only header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace e4kv::cuda {

// Occupies `stream` for about `micros` microseconds (one CTA of one thread).
void profile_spin(int64_t micros, cudaStream_t stream);

}  // namespace e4kv::cuda
