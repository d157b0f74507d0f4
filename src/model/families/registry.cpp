// load_model: the family a checkpoint's config names, loaded. A new family adds its test here.
#include "model/families/dense.h"
#include "model/families/qwen4exp.h"
#include "model/model.h"

namespace e4kv {

Result<std::unique_ptr<Model>> load_model(const Checkpoint& ckpt, Backend& backend,
                                          const ModelOptions& options) {
  if (is_qwen4exp(ckpt.config())) {
    E4KV_ASSIGN_OR_RETURN(std::unique_ptr<Qwen4ExpModel> model,
                          Qwen4ExpModel::load(ckpt, backend, options));
    return std::unique_ptr<Model>(std::move(model));
  }
  // Every other config goes to the dense families, whose spec check names the architecture when
  // none of them runs it.
  E4KV_ASSIGN_OR_RETURN(std::unique_ptr<DenseModel> model,
                        DenseModel::load(ckpt, backend, options));
  return std::unique_ptr<Model>(std::move(model));
}

}  // namespace e4kv
