// Hands a forward's intermediate tensors to its ForwardProbe (model.h): host copies, taken in
// order with the backend's ops. Each call is a no-op without a probe.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "model/model.h"

namespace e4kv {

// out: [n_rows, q_dim] fp32 in backend memory.
void probe_attention_output(Backend& backend, ForwardProbe* probe, int64_t layer, const float* out,
                            int64_t n_rows, int64_t q_dim);
// in: [n_rows, hidden] act in backend memory (`bytes` of it); the probe may replace it.
void probe_attention_input(Backend& backend, ForwardProbe* probe, int64_t layer, void* in,
                           size_t bytes);
// tokens: [n_rows, width], counts: [n_rows] int32 in backend memory.
void probe_qsa_selection(Backend& backend, ForwardProbe* probe, int64_t layer,
                         const int32_t* tokens, const int32_t* counts, int64_t n_rows,
                         int64_t width);

}  // namespace e4kv
