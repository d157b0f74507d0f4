// e4kv logits MODEL --ids 1,2,3 [--json]: one forward over the ids; the fp32 logits of every
// position. --json prints {"logits": [[vocab floats] per position]}; without it, one line per
// position with the most likely next tokens.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "commands.h"
#include "model_setup.h"

namespace e4kv::cli {
namespace {

struct LogitsArgs {
  ModelFlags model;
  std::string ids;
  bool json = false;
};

// Shortest text that reads back as the same float.
void append_float(std::string& out, float value) {
  char buffer[32];
  auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, ec == std::errc() ? end : buffer);
}

Status run_logits(const LogitsArgs& args) {
  E4KV_RETURN_IF_ERROR(validate_model_flags(args.model));
  E4KV_ASSIGN_OR_RETURN(std::vector<int32_t> ids, parse_id_list("--ids", args.ids));
  E4KV_ASSIGN_OR_RETURN(LoadedModel loaded,
                        load_model(args.model, static_cast<int64_t>(ids.size()),
                                   static_cast<int64_t>(ids.size())));
  Model& model = *loaded.model;
  const int64_t n = static_cast<int64_t>(ids.size());
  if (n > model.max_model_len()) {
    return Status::error(
        cat("--ids has ", n, " tokens, more than the max model length ", model.max_model_len()));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= model.vocab_size()) {
      return Status::error(cat("--ids: entry ", i, " is id ", ids[i],
                               ", outside the model's vocabulary [0, ", model.vocab_size(), ")"));
    }
  }
  BlockAllocator allocator(model.n_blocks(), model.block_size());
  BlockTable table;
  allocator.append(table, n);
  std::vector<int32_t> seq(ids.size(), 0);
  std::vector<int32_t> pos(ids.size());
  std::iota(pos.begin(), pos.end(), 0);
  E4KV_ASSIGN_OR_RETURN(ScopedSequence sequence, ScopedSequence::allocate(model));
  const int32_t slot = sequence.slot();
  ForwardBatch batch{ids, seq, pos, {&table}, pos, std::span<const int32_t>(&slot, 1)};
  E4KV_ASSIGN_OR_RETURN(std::vector<float> logits, model.forward(batch));
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) {
      return Status::error(cat("the model produced a non-finite logit at position ",
                               i / size_t(model.vocab_size())));
    }
  }
  const size_t vocab = static_cast<size_t>(model.vocab_size());
  if (args.json) {
    std::string out = "{\"logits\": [";
    out.reserve(logits.size() * 12);
    for (size_t t = 0; t < ids.size(); ++t) {
      out += t == 0 ? "[" : ", [";
      for (size_t j = 0; j < vocab; ++j) {
        if (j > 0) out += ", ";
        append_float(out, logits[t * vocab + j]);
      }
      out += "]";
    }
    out += "]}\n";
    std::fwrite(out.data(), 1, out.size(), stdout);
    return ok_status();
  }
  for (size_t t = 0; t < ids.size(); ++t) {
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    const float* row = logits.data() + t * vocab;
    const size_t k = std::min<size_t>(5, vocab);
    std::partial_sort(
        order.begin(), order.begin() + long(k), order.end(),
        [row](int32_t a, int32_t b) { return row[a] != row[b] ? row[a] > row[b] : a < b; });
    std::printf("position %zu (id %d):", t, ids[t]);
    for (size_t i = 0; i < k; ++i) std::printf(" %d:%.4f", order[i], double(row[order[i]]));
    std::printf("\n");
  }
  return ok_status();
}

}  // namespace

void add_logits_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "logits", "Run one forward over token ids and print the logits of every position");
  auto args = std::make_shared<LogitsArgs>();
  add_model_flags(cmd, args->model);
  cmd->add_option("--ids", args->ids, "Token ids, comma-separated (1,2,3)")->required();
  cmd->add_flag("--json", args->json, "Print {\"logits\": [[...] per position]} (fp32)");
  cmd->callback([args, &result] { result = run_logits(*args); });
}

}  // namespace e4kv::cli
