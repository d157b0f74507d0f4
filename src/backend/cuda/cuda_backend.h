// The CUDA implementation of Backend (backend/backend.h): FP16 activations and weights with fp32
// accumulation, cuBLAS for linear, e4kv's kernels for the cache write and paged attention (route
// planned: tensor-core prefill tiles and split-K decode rows), small kernels for the rest
// (backend/cuda/model_ops.cuh). Every op runs on one stream owned by the backend. Host-only header
// without CUDA includes, so the command-line program can name it.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "backend/profiler.h"
#include "core/status.h"

namespace e4kv {

struct CudaBackendOptions {
  int device = 0;
  // Use the software E4M3 decoder even where the native conversion exists (sm_89+), as
  // E4KV_FORCE_SOFTWARE_E4M3=1 does.
  bool force_software_e4m3 = false;
};

// Errors: no CUDA device, or `device` out of range.
Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendOptions& options = {});

// The step profiler of a CUDA backend (CUDA events on its stream; Model::set_step_profiler);
// nullptr for a backend make_cuda_backend did not make.
StepProfiler* cuda_step_profiler(Backend& backend);

}  // namespace e4kv
