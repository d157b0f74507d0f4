// Loading a family's tensors by name: each one checked for presence and shape (the shape the
// config implies, named in the error), uploaded to the backend, and recorded, so that after the
// family has taken what it needs every tensor left over is an error naming it (a part of the
// model the runtime would silently skip). K/V scale keys and recomputed rotary buffers are never
// left over.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "io/checkpoint.h"

namespace e4kv {

class WeightLoader {
 public:
  // family: how errors name what needs the tensors ("a llama checkpoint needs it").
  WeightLoader(const Checkpoint& ckpt, Backend& backend, std::string family);

  // The tensor `name` of exactly `shape`, uploaded. meaning: the shape in config terms
  // ("[hidden_size]").
  Result<BackendBuffer> load(const std::string& name, const std::vector<int64_t>& shape,
                             std::string_view meaning);
  bool has(const std::string& name) const { return ckpt_->find(name) != nullptr; }
  // Counts `name` as used without uploading it (a tied lm_head).
  void mark_used(const std::string& name) { used_.insert(name); }

  // An error listing the tensors nothing loaded (at most 5 named, then the count).
  Status check_all_used() const;

 private:
  const Checkpoint* ckpt_;
  Backend* backend_;
  std::string family_;
  std::set<std::string, std::less<>> used_;
};

std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace e4kv
