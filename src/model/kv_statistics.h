// The calibration statistics of a model's KV-cache layers (Model::start_kv_statistics): one
// backend accumulator per KV-cache layer, handed to that layer's cache write in kServe forwards
// only. Both families hold one.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "kv/kv_cache_view.h"
#include "model/model.h"

namespace e4kv {

class KvStatisticsCollector {
 public:
  // kv_layers: the model's KV-cache layers (increasing); n_layers: all its layers.
  // Errors: an E4M3 cache; a backend that cannot allocate the accumulators.
  Status start(Backend& backend, int64_t n_layers, const std::vector<int64_t>& kv_layers,
               KvCacheDtype cache_dtype);
  // The accumulator for `layer`'s cache write in a forward of `purpose`: nullptr when not
  // collecting, for a purpose other than kServe, or for a layer without a KV cache.
  KvWriteStats* sink(int64_t layer, ForwardPurpose purpose) const;
  Result<std::vector<LayerKvStats>> read() const;
  void stop();
  bool collecting() const { return !per_layer_.empty(); }

 private:
  std::vector<std::unique_ptr<KvWriteStats>> per_layer_;  // [n_layers]; empty: not collecting
  std::vector<int64_t> kv_layers_;
};

}  // namespace e4kv
