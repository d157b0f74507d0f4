#include "engine/generate.h"

#include <algorithm>

#include "engine/engine.h"

namespace e4kv {

Result<GenerateResult> generate(Model& model, std::span<const int32_t> prompt,
                                const GenerateOptions& options,
                                const std::function<void(int32_t)>& on_token) {
  EngineConfig config;
  config.max_num_seqs = 1;
  config.enforce_eager = options.enforce_eager;
  // The prompt in forwards of at most prefill_chunk rows (the scheduler's token budget).
  if (options.prefill_chunk > 0) config.max_num_batched_tokens = options.prefill_chunk;
  Engine engine(model, config);
  RequestParams params;
  params.sampling = options.sampling;
  params.max_tokens = options.max_tokens;
  params.stop_ids = options.stop_ids;
  E4KV_ASSIGN_OR_RETURN(const RequestId id,
                        engine.add_request(std::vector<int32_t>(prompt.begin(), prompt.end()),
                                           params));
  GenerateResult result;
  result.finish_reason = "length";
  while (engine.has_unfinished()) {
    E4KV_ASSIGN_OR_RETURN(const std::vector<RequestUpdate> updates, engine.step());
    for (const RequestUpdate& u : updates) {
      if (u.id != id) continue;
      for (int32_t token : u.new_tokens) {
        result.output_ids.push_back(token);
        if (on_token) on_token(token);
      }
      if (u.finished) {
        if (u.finish_reason == "error") return Status::error(u.error);
        result.finish_reason = u.finish_reason;
      }
    }
  }
  return result;
}

}  // namespace e4kv
