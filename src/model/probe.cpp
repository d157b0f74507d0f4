#include "model/probe.h"

#include <vector>

namespace e4kv {

void probe_attention_output(Backend& backend, ForwardProbe* probe, int64_t layer, const float* out,
                            int64_t n_rows, int64_t q_dim) {
  if (probe == nullptr) return;
  std::vector<float> host(static_cast<size_t>(n_rows * q_dim));
  backend.copy_to_host(host.data(), out, host.size() * sizeof(float));
  probe->attention_output(layer, host, q_dim);
}

void probe_attention_input(Backend& backend, ForwardProbe* probe, int64_t layer, void* in,
                           size_t bytes) {
  if (probe == nullptr || !probe->wants_attention_input()) return;
  std::vector<std::byte> host(bytes);
  backend.copy_to_host(host.data(), in, bytes);
  if (probe->attention_input(layer, host)) backend.copy_from_host(in, host.data(), bytes);
}

void probe_qsa_selection(Backend& backend, ForwardProbe* probe, int64_t layer,
                         const int32_t* tokens, const int32_t* counts, int64_t n_rows,
                         int64_t width) {
  if (probe == nullptr) return;
  std::vector<int32_t> host_tokens(static_cast<size_t>(n_rows * width));
  std::vector<int32_t> host_counts(static_cast<size_t>(n_rows));
  backend.copy_to_host(host_tokens.data(), tokens, host_tokens.size() * sizeof(int32_t));
  backend.copy_to_host(host_counts.data(), counts, host_counts.size() * sizeof(int32_t));
  probe->qsa_selection(layer, host_tokens, host_counts, width);
}

}  // namespace e4kv
