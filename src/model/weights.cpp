#include "model/weights.h"

#include <algorithm>
#include <utility>

#include "kv/scale_keys.h"

namespace e4kv {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += cat(i == 0 ? "" : ", ", shape[i]);
  return out + "]";
}

WeightLoader::WeightLoader(const Checkpoint& ckpt, Backend& backend, std::string family)
    : ckpt_(&ckpt), backend_(&backend), family_(std::move(family)) {}

Result<BackendBuffer> WeightLoader::load(const std::string& name,
                                         const std::vector<int64_t>& shape,
                                         std::string_view meaning) {
  const SafetensorsTensor* tensor = ckpt_->find(name);
  if (tensor == nullptr) {
    return Status::error(cat(ckpt_->dir().string(), ": tensor ", name, " is missing (a ", family_,
                             " checkpoint needs it)"));
  }
  if (tensor->shape != shape) {
    return Status::error(cat(ckpt_->dir().string(), ": tensor ", name, " has shape ",
                             shape_text(tensor->shape), " but config.json implies ",
                             shape_text(shape), " (", meaning,
                             "); the checkpoint and its config.json disagree"));
  }
  used_.insert(name);
  Result<BackendBuffer> buffer = backend_->upload_weight(*tensor);
  if (!buffer.ok()) return Status::error(cat(ckpt_->dir().string(), ": ", buffer.message()));
  return buffer;
}

Status WeightLoader::check_all_used() const {
  std::vector<std::string> unexpected;
  for (const std::string& name : ckpt_->tensor_names()) {
    if (used_.count(name) != 0 || parse_scale_key(name)) continue;
    if (std::string_view(name).ends_with(".rotary_emb.inv_freq")) continue;  // recomputed
    unexpected.push_back(name);
  }
  if (unexpected.empty()) return ok_status();
  std::string list;
  for (size_t i = 0; i < std::min<size_t>(5, unexpected.size()); ++i) {
    list += cat(i == 0 ? "" : ", ", unexpected[i]);
  }
  if (unexpected.size() > 5) list += cat(", ... (", unexpected.size(), " in all)");
  return Status::error(cat(ckpt_->dir().string(), ": tensors the ", family_,
                           " runtime does not use (a config.json mismatch or an unsupported "
                           "variant): ",
                           list));
}

}  // namespace e4kv
