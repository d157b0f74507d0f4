// The CPU implementation of Backend: fp32 activations and weights, OpenBLAS sgemm for linear, the
// reference cache write and paged attention (the oracles) for the cache, a small parallel-for over
// rows for the rest. Synchronous: every op has finished when it returns.
#pragma once

#include <cstdint>
#include <memory>

#include "backend/backend.h"

namespace e4kv {

struct CpuBackendOptions {
  // Threads for the row-parallel ops (norm, RoPE, attention, elementwise); 0: one per hardware
  // thread. OpenBLAS keeps its own thread setting (OPENBLAS_NUM_THREADS).
  int n_threads = 0;
};

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendOptions& options = {});

// Tests: a CPU backend made by make_cpu_backend records "graphs" as the functions given to
// Backend::capture_graph and replays them by calling them again, so the engine's step-graph path
// (buckets, padding rows, signatures) runs on the CPU. No effect on another backend.
void cpu_backend_emulate_graphs(Backend& backend, bool on);

}  // namespace e4kv
