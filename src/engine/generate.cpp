#include "engine/generate.h"

#include <algorithm>
#include <cmath>

#include "kv/block_allocator.h"

namespace e4kv {
namespace {

// Appends `ids` at positions [table.n_tokens, ...) and returns the last row's logits.
Result<std::vector<float>> feed(Model& model, BlockAllocator& allocator, BlockTable& table,
                                int32_t slot, std::span<const int32_t> ids) {
  const int64_t n = static_cast<int64_t>(ids.size());
  if (!allocator.can_append(table, n)) {
    return Status::error(cat("the KV cache is full: ", allocator.n_blocks(), " blocks of ",
                             allocator.block_size(), " tokens cannot hold ", table.n_tokens + n,
                             " tokens; allow more blocks"));
  }
  const int64_t start = table.n_tokens;
  allocator.append(table, n);
  std::vector<int32_t> seq(ids.size(), 0);
  std::vector<int32_t> pos(ids.size());
  for (int64_t i = 0; i < n; ++i) pos[size_t(i)] = static_cast<int32_t>(start + i);
  const int32_t last = static_cast<int32_t>(n - 1);
  ForwardBatch batch{ids,
                     seq,
                     pos,
                     {&table},
                     std::span<const int32_t>(&last, 1),
                     std::span<const int32_t>(&slot, 1)};
  return model.forward(batch);
}

}  // namespace

Result<GenerateResult> generate(Model& model, std::span<const int32_t> prompt,
                                const GenerateOptions& options,
                                const std::function<void(int32_t)>& on_token) {
  E4KV_RETURN_IF_ERROR(validate_sampling_params(options.sampling));
  if (prompt.empty()) return Status::error("the prompt is empty; give at least one token");
  if (options.max_tokens < 0) {
    return Status::option_error("max_tokens", cat("must be >= 0, got ", options.max_tokens));
  }
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  if (prompt_len >= model.max_model_len()) {
    return Status::error(cat("the prompt has ", prompt_len, " tokens; the max model length is ",
                             model.max_model_len(), " (prompt plus generated tokens)"));
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model.vocab_size()) {
      return Status::error(cat("prompt token ", i, " is id ", prompt[i],
                               ", outside the model's vocabulary [0, ", model.vocab_size(), ")"));
    }
  }

  GenerateResult result;
  result.finish_reason = "length";
  if (options.max_tokens == 0) return result;

  BlockAllocator allocator(model.n_blocks(), model.block_size());
  BlockTable table;
  E4KV_ASSIGN_OR_RETURN(ScopedSequence sequence, ScopedSequence::allocate(model));
  Sampler sampler(options.sampling);
  // The prompt in forwards of at most the model's batch limit.
  const int64_t chunk = std::min(options.prefill_chunk > 0 ? options.prefill_chunk : prompt_len,
                                 model.limits().max_batch_tokens);
  Result<std::vector<float>> logits = Status::error("no forward ran");
  std::vector<int32_t> seen(prompt.begin(), prompt.end());  // for the repetition penalty
  for (int64_t begin = 0; begin < prompt_len; begin += chunk) {
    const int64_t n = std::min(chunk, prompt_len - begin);
    logits =
        feed(model, allocator, table, sequence.slot(), prompt.subspan(size_t(begin), size_t(n)));
    if (!logits.ok()) return logits.status();
  }
  while (true) {
    for (float value : *logits) {
      if (!std::isfinite(value)) {
        return Status::error(
            cat("the model produced non-finite logits after ", table.n_tokens, " tokens"));
      }
    }
    if (options.sampling.repetition_penalty != 1.0) {
      if (!result.output_ids.empty()) seen.push_back(result.output_ids.back());
      apply_repetition_penalty(*logits, seen, options.sampling.repetition_penalty);
    }
    const int32_t token = sampler.sample(*logits);
    result.output_ids.push_back(token);
    if (on_token) on_token(token);
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) !=
        options.stop_ids.end()) {
      result.finish_reason = "stop";
      break;
    }
    if (static_cast<int64_t>(result.output_ids.size()) >= options.max_tokens ||
        table.n_tokens + 1 >= model.max_model_len()) {
      break;
    }
    logits = feed(model, allocator, table, sequence.slot(), std::span<const int32_t>(&token, 1));
    if (!logits.ok()) return logits.status();
  }
  allocator.free(table);
  return result;
}

}  // namespace e4kv
