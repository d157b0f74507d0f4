#include "model/kv_statistics.h"

namespace e4kv {

Status KvStatisticsCollector::start(Backend& backend, int64_t n_layers,
                                    const std::vector<int64_t>& kv_layers,
                                    KvCacheDtype cache_dtype) {
  if (cache_dtype != KvCacheDtype::kF16) {
    return Status::error(
        "calibration statistics need the FP16 KV cache (--kv-cache-dtype fp16): the scales are "
        "measured on the values an FP16 cache stores, before any E4M3 rounding");
  }
  std::vector<std::unique_ptr<KvWriteStats>> per_layer(static_cast<size_t>(n_layers));
  for (int64_t layer : kv_layers) {
    E4KV_ASSIGN_OR_RETURN(per_layer[size_t(layer)], backend.make_kv_write_stats());
  }
  per_layer_ = std::move(per_layer);
  kv_layers_ = kv_layers;
  return ok_status();
}

KvWriteStats* KvStatisticsCollector::sink(int64_t layer, ForwardPurpose purpose) const {
  if (purpose != ForwardPurpose::kServe || per_layer_.empty()) return nullptr;
  return per_layer_[size_t(layer)].get();
}

Result<std::vector<LayerKvStats>> KvStatisticsCollector::read() const {
  if (per_layer_.empty()) {
    return Status::error("kv_statistics: collecting was not started (start_kv_statistics)");
  }
  std::vector<LayerKvStats> out;
  for (int64_t layer : kv_layers_) {
    auto [k, v] = per_layer_[size_t(layer)]->read();
    out.push_back(LayerKvStats{layer, std::move(k), std::move(v)});
  }
  return out;
}

void KvStatisticsCollector::stop() {
  per_layer_.clear();
  kv_layers_.clear();
}

}  // namespace e4kv
