// The CUDA implementation of Backend (backend/backend.h): FP16 activations and weights with fp32
// accumulation, cuBLAS for linear, e4kv's kernels for the cache write and paged attention (route
// planned: tensor-core prefill tiles and split-K decode rows), small kernels for the rest
// (backend/cuda/model_ops.cuh). Every op runs on one stream owned by the backend. Host-only header
// without CUDA includes, so the command-line program can name it.
#pragma once

#include <cstdint>
#include <functional>
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
  // The hyper-connection mix's earlier warp-per-slice kernels (cuda::HcMixKernels::kWarpPerSlice)
  // instead of the load-first pair, as E4KV_HC_MIX_KERNELS=warp-per-slice does (for A/B
  // benchmarks: the load-first pair took the batch-1 step of the Qwen4Exp benchmark checkpoint
  // from 8.06 to 7.31 ms on an H100).
  bool hc_mix_warp_per_slice = false;
  // At decode, the MoE shared expert as one more pair in the routed experts' launches
  // (Backend::moe_route_experts_shared) instead of its own MLP (three launches), as
  // E4KV_MOE_SHARED_EXPERT=fused does. Off until its first GPU round has passed its test and
  // measured it; E4KV_MOE_SHARED_EXPERT=separate keeps it off.
  bool moe_shared_expert_fused = false;
};

// Errors: no CUDA device, `device` out of range, E4KV_HC_MIX_KERNELS set to something other than
// load-first or warp-per-slice, E4KV_MOE_SHARED_EXPERT to something other than fused or separate.
Result<std::unique_ptr<Backend>> make_cuda_backend(const CudaBackendOptions& options = {});

// The step profiler of a CUDA backend (CUDA events on its stream; Model::set_step_profiler);
// nullptr for a backend make_cuda_backend did not make.
StepProfiler* cuda_step_profiler(Backend& backend);

// What a CUDA backend has done that a forward's device half must not: device or page-locked
// allocations (allocate, allocate_host, workspace growth, reserves) and host waits (synchronize,
// copy_to_host, a workspace growth). Tests read them around a forward.
struct CudaBackendCounters {
  int64_t allocations = 0;
  int64_t host_waits = 0;
};
// The counters of a backend made by make_cuda_backend (all zero for another backend).
CudaBackendCounters cuda_backend_counters(const Backend& backend);

// The launch signature of the step's attention plans (PagedAttentionRunner::plan_signature): a
// graph captured after one step's host half replays another's only where the signatures are
// equal (0 for another backend).
uint64_t cuda_attention_plan_signature(const Backend& backend);

// A CUDA graph of the ops issued on a CUDA backend's stream (Backend::capture_graph: global
// capture mode, so an allocation, a wait for the device or a copy from pageable memory inside the
// capture fails it). Replays read the device buffers the ops were issued on, so refresh them first
// (a model's host half) and replay.
using CudaGraph = BackendGraph;
Result<std::unique_ptr<CudaGraph>> capture_cuda_graph(Backend& backend,
                                                      const std::function<Status()>& issue);

}  // namespace e4kv
