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

Result<BackendBuffer> WeightLoader::load(const std::string& name, const std::vector<int64_t>& shape,
                                         std::string_view meaning) {
  E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* tensor, find(name, shape, meaning));
  Result<BackendBuffer> buffer = backend_->upload_weight(*tensor);
  if (!buffer.ok()) return Status::error(cat(ckpt_->dir().string(), ": ", buffer.message()));
  return buffer;
}

Result<const SafetensorsTensor*> WeightLoader::find(const std::string& name,
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
  use(name);
  return tensor;
}

Result<BackendBuffer> WeightLoader::upload_host(const std::string& name, DType dtype,
                                                std::vector<int64_t> shape,
                                                std::vector<std::byte> bytes) {
  SafetensorsTensor tensor;
  tensor.name = name;
  tensor.dtype = dtype;
  tensor.shape = std::move(shape);
  tensor.end = bytes.size();
  tensor.bytes = std::span<const std::byte>(bytes.data(), bytes.size());
  Result<BackendBuffer> buffer = backend_->upload_weight(tensor);
  if (!buffer.ok()) return Status::error(cat(ckpt_->dir().string(), ": ", buffer.message()));
  return buffer;
}

Result<BackendBuffer> WeightLoader::load_concat(const std::vector<std::string>& names,
                                                const std::vector<int64_t>& part_shape,
                                                std::string_view meaning) {
  E4KV_ASSERT(!names.empty() && !part_shape.empty(), "load_concat: nothing to load");
  std::vector<std::byte> bytes;
  DType dtype = DType::kU8;
  for (size_t i = 0; i < names.size(); ++i) {
    E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* tensor, find(names[i], part_shape, meaning));
    if (i == 0) {
      dtype = tensor->dtype;
      bytes.reserve(tensor->bytes.size() * names.size());
    } else if (tensor->dtype != dtype) {
      return Status::error(cat(ckpt_->dir().string(), ": tensor ", names[i], " is ",
                               dtype_name(tensor->dtype), " but ", names[0], " is ",
                               dtype_name(dtype), "; the runtime stacks them into one tensor"));
    }
    bytes.insert(bytes.end(), tensor->bytes.begin(), tensor->bytes.end());
  }
  std::vector<int64_t> shape = part_shape;
  shape[0] *= int64_t(names.size());
  return upload_host(names[0], dtype, std::move(shape), std::move(bytes));
}

Result<BackendBuffer> WeightLoader::load_rows(const std::string& name,
                                              const std::vector<int64_t>& shape,
                                              std::string_view meaning, int64_t begin,
                                              int64_t count) {
  E4KV_ASSERT(!shape.empty(), "load_rows: a scalar has no rows");
  if (begin == 0 && count == shape[0]) return load(name, shape, meaning);
  return load_row_ranges(name, shape, meaning, {{begin, count}});
}

Result<BackendBuffer> WeightLoader::load_row_ranges(const std::string& name,
                                                    const std::vector<int64_t>& shape,
                                                    std::string_view meaning,
                                                    const std::vector<RowRange>& ranges) {
  E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* tensor, find(name, shape, meaning));
  E4KV_ASSERT(!shape.empty() && shape[0] > 0, "load_row_ranges: a tensor without rows");
  const size_t row_bytes = tensor->bytes.size() / size_t(shape[0]);
  std::vector<std::byte> bytes;
  int64_t rows = 0;
  for (const RowRange& r : ranges) {
    E4KV_ASSERT(r.begin >= 0 && r.count > 0 && r.begin + r.count <= shape[0],
                "load_row_ranges: rows out of range");
    bytes.insert(bytes.end(), tensor->bytes.begin() + long(size_t(r.begin) * row_bytes),
                 tensor->bytes.begin() + long(size_t(r.begin + r.count) * row_bytes));
    rows += r.count;
  }
  std::vector<int64_t> part = shape;
  part[0] = rows;
  return upload_host(name, tensor->dtype, std::move(part), std::move(bytes));
}

Result<BackendBuffer> WeightLoader::load_row_blocks(const std::string& name,
                                                    const std::vector<int64_t>& shape,
                                                    std::string_view meaning, int64_t block_rows,
                                                    const std::vector<int64_t>& order) {
  E4KV_ASSIGN_OR_RETURN(const SafetensorsTensor* tensor, find(name, shape, meaning));
  const int64_t rows = shape[0];
  E4KV_ASSERT(
      block_rows > 0 && rows % block_rows == 0 && int64_t(order.size()) == rows / block_rows,
      "load_row_blocks: the blocks do not tile the rows");
  const size_t block_bytes = tensor->bytes.size() / order.size();
  std::vector<std::byte> bytes(tensor->bytes.size());
  for (size_t i = 0; i < order.size(); ++i) {
    std::copy_n(tensor->bytes.begin() + long(size_t(order[i]) * block_bytes), block_bytes,
                bytes.begin() + long(i * block_bytes));
  }
  return upload_host(name, tensor->dtype, shape, std::move(bytes));
}

void WeightLoader::set_progress(Progress progress) {
  progress_ = std::move(progress);
  total_bytes_ = 0;
  for (const std::string& name : ckpt_->tensor_names()) {
    if (const SafetensorsTensor* t = ckpt_->find(name); t != nullptr)
      total_bytes_ += t->bytes.size();
  }
  done_bytes_ = 0;
  for (const std::string& name : used_) {
    if (const SafetensorsTensor* t = ckpt_->find(name); t != nullptr)
      done_bytes_ += t->bytes.size();
  }
  reported_bytes_ = done_bytes_;
}

void WeightLoader::use(const std::string& name) {
  if (!used_.insert(name).second || !progress_) return;
  if (const SafetensorsTensor* t = ckpt_->find(name); t != nullptr) done_bytes_ += t->bytes.size();
  if (done_bytes_ - reported_bytes_ >= total_bytes_ / 100 || done_bytes_ == total_bytes_) {
    reported_bytes_ = done_bytes_;
    progress_(done_bytes_, total_bytes_);
  }
}

int64_t WeightLoader::skip_prefix(std::string_view prefix) {
  int64_t count = 0;
  for (const std::string& name : ckpt_->tensor_names()) {
    if (std::string_view(name).starts_with(prefix)) {
      use(name);
      ++count;
    }
  }
  return count;
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
