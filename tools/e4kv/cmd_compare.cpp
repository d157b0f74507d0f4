// e4kv compare MODEL --prompts FILE.jsonl: FP16 KV against calibrated E4M3 KV (and, with
// --with-unit-control, unit-scale E4M3 as the negative control) on identical token ids, greedy
// (measures: calib/compare.h, DESIGN.md section 8). MODEL must carry calibrated K/V scales (an
// overlay): the E4M3 model passes the start-up gate or the command stops.
//
// The models are loaded side by side on one backend (weights once per mode), so that each prompt
// runs through every mode chunk by chunk and only one chunk's intermediate tensors are held:
//   teacher-forced: each prompt in forwards of --prefill-chunk rows, logits of every row; the
//     FP16 forward first (its attention outputs and QSA selections captured by a ForwardProbe),
//     then each E4M3 mode's forward of the same rows, compared as its probe sees them;
//   free-running: greedy continuations of --max-tokens from each prompt in every mode;
//   --task passkey: generated retrieval prompts (a key in filler text at each --depths percent of
//     each --context length), greedy, correct when the continuation holds the key.
// With --ple-dtype fp8_e4m3 every mode (the FP16 reference too) reads the PLE tables as E4M3, held
// once for all modes, and the report gives the tables' error against the checkpoint's values.
// Prints the Markdown table; --out DIR also writes compare.json, compare.md and compare.svg.
#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "calib/compare.h"
#include "commands.h"
#include "core/check.h"
#include "core/file_io.h"
#include "core/output_set.h"
#include "engine/generate.h"
#include "io/checkpoint.h"
#include "io/corpus.h"
#include "io/generation_config.h"
#include "kv/block_allocator.h"
#include "kv/scale_gate.h"
#include "model/model.h"
#include "model_setup.h"
#include "numeric_flags.h"
#include "prompt_source.h"

namespace e4kv::cli {
namespace {

namespace fs = std::filesystem;

struct CompareArgs {
  ModelFlags model;
  std::string prompts;
  int64_t max_tokens = 16;
  bool unit_control = false;
  std::string out;
  bool force = false;
  int64_t prefill_chunk = 256;
  std::string task;
  std::string contexts = "1k";
  std::string depths = "0,50,100";
  int64_t passkey_trials = 1;
  bool isolated = false;
  bool special_tokens_in_content = false;
};

// What one forward of the FP16 model showed its probe (with capture_inputs, also every attention
// layer's input).
class CaptureProbe final : public ForwardProbe {
 public:
  bool wants_attention_input() const override { return capture_inputs; }
  bool attention_input(int64_t layer, std::span<std::byte> in) override {
    inputs[layer].assign(in.begin(), in.end());
    return false;
  }
  void attention_output(int64_t layer, std::span<const float> out, int64_t) override {
    outputs[layer].assign(out.begin(), out.end());
  }
  void qsa_selection(int64_t layer, std::span<const int32_t> tokens,
                     std::span<const int32_t> counts, int64_t w) override {
    selections[layer] = {std::vector<int32_t>(tokens.begin(), tokens.end()),
                         std::vector<int32_t>(counts.begin(), counts.end())};
    width = w;
  }

  std::map<int64_t, std::vector<float>> outputs;
  std::map<int64_t, std::pair<std::vector<int32_t>, std::vector<int32_t>>> selections;
  int64_t width = 0;
  bool capture_inputs = false;
  std::map<int64_t, std::vector<std::byte>> inputs;
};

// An E4M3 forward's probe: compares what it sees with the FP16 capture of the same rows.
class CompareProbe final : public ForwardProbe {
 public:
  CompareProbe(const CaptureProbe& ref, ModeCompare& mode) : ref_(ref), mode_(mode) {}
  void attention_output(int64_t layer, std::span<const float> out, int64_t) override {
    const auto it = ref_.outputs.find(layer);
    if (it == ref_.outputs.end()) return;
    mode_.add_output(layer, ref_.selections.contains(layer), out, it->second);
  }
  void qsa_selection(int64_t layer, std::span<const int32_t> tokens,
                     std::span<const int32_t> counts, int64_t width) override {
    const auto it = ref_.selections.find(layer);
    if (it == ref_.selections.end()) return;
    mode_.add_selection(layer, tokens, counts, it->second.first, it->second.second, width);
  }

 private:
  const CaptureProbe& ref_;
  ModeCompare& mode_;
};

// An E4M3 forward of the isolated pass: every attention layer reads the FP16 capture's input for
// that layer; its output is compared with the capture's.
class ReplayProbe final : public ForwardProbe {
 public:
  ReplayProbe(const CaptureProbe& ref, ModeCompare& mode) : ref_(ref), mode_(mode) {}
  bool wants_attention_input() const override { return true; }
  bool attention_input(int64_t layer, std::span<std::byte> in) override {
    const auto it = ref_.inputs.find(layer);
    E4KV_ASSERT(it != ref_.inputs.end() && it->second.size() == in.size(),
                "compare --isolated: the FP16 run has no input of this layer's size");
    std::copy(it->second.begin(), it->second.end(), in.begin());
    return true;
  }
  void attention_output(int64_t layer, std::span<const float> out, int64_t) override {
    const auto it = ref_.outputs.find(layer);
    if (it == ref_.outputs.end()) return;
    mode_.add_isolated_output(layer, ref_.selections.contains(layer), out, it->second);
  }
  void qsa_selection(int64_t, std::span<const int32_t>, std::span<const int32_t>,
                     int64_t) override {}

 private:
  const CaptureProbe& ref_;
  ModeCompare& mode_;
};

// One model (a KV mode) and its sequence for the prompt at hand.
struct Runner {
  std::unique_ptr<Model> model;
  std::optional<BlockAllocator> allocator;
  BlockTable table;
  std::optional<ScopedSequence> sequence;

  Status begin() {
    allocator.emplace(model->n_blocks(), model->block_size());
    table = BlockTable{};
    sequence.reset();
    E4KV_ASSIGN_OR_RETURN(ScopedSequence held, ScopedSequence::allocate(*model));
    sequence.emplace(std::move(held));
    return ok_status();
  }
  // Rows ids[begin, begin + n) of the prompt; logits of every row.
  Result<std::vector<float>> forward(std::span<const int32_t> ids, int64_t begin,
                                     ForwardProbe* probe) {
    allocator->append(table, int64_t(ids.size()));
    std::vector<int32_t> seq(ids.size(), 0), pos(ids.size()), rows(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      pos[i] = int32_t(begin + int64_t(i));
      rows[i] = int32_t(i);
    }
    const int32_t slot = sequence->slot();
    ForwardBatch batch{ids, seq, pos, {&table}, rows, std::span<const int32_t>(&slot, 1)};
    batch.probe = probe;
    return model->forward(batch);
  }
};

int32_t argmax(std::span<const float> row) {
  return int32_t(std::max_element(row.begin(), row.end()) - row.begin());
}

// Teacher-forced pass of one prompt through the reference and every mode.
Status teacher_forced(std::span<const int32_t> ids, int64_t chunk, Runner& ref_runner,
                      std::vector<Runner>& runners, ModeCompare& ref_mode,
                      std::vector<ModeCompare>& modes, int64_t vocab) {
  E4KV_RETURN_IF_ERROR(ref_runner.begin());
  for (Runner& r : runners) E4KV_RETURN_IF_ERROR(r.begin());
  const int64_t n_ids = int64_t(ids.size());
  std::vector<float> ref_last, mode_last;
  for (int64_t begin = 0; begin < n_ids; begin += chunk) {
    const int64_t n = std::min(chunk, n_ids - begin);
    const std::span<const int32_t> rows = ids.subspan(size_t(begin), size_t(n));
    CaptureProbe capture;
    E4KV_ASSIGN_OR_RETURN(std::vector<float> ref_logits, ref_runner.forward(rows, begin, &capture));
    for (int64_t r = 0; r < n; ++r) {
      const int64_t p = begin + r;
      if (p + 1 >= n_ids) continue;
      ref_mode.sum_nll += next_token_nll(
          std::span<const float>(ref_logits).subspan(size_t(r * vocab), size_t(vocab)),
          ids[size_t(p + 1)]);
      ref_mode.nll_tokens += 1;
    }
    for (size_t m = 0; m < runners.size(); ++m) {
      CompareProbe probe(capture, modes[m]);
      E4KV_ASSIGN_OR_RETURN(std::vector<float> logits, runners[m].forward(rows, begin, &probe));
      for (int64_t r = 0; r < n; ++r) {
        const int64_t p = begin + r;
        const std::span<const float> test =
            std::span<const float>(logits).subspan(size_t(r * vocab), size_t(vocab));
        const std::span<const float> ref =
            std::span<const float>(ref_logits).subspan(size_t(r * vocab), size_t(vocab));
        if (p + 1 < n_ids) {
          modes[m].sum_kl += next_token_kl(ref, test);
          modes[m].kl_positions += 1;
          modes[m].sum_nll += next_token_nll(test, ids[size_t(p + 1)]);
          modes[m].nll_tokens += 1;
        } else {
          modes[m].first_token_equal += argmax(test) == argmax(ref) ? 1 : 0;
        }
      }
    }
  }
  ref_mode.prompts += 1;
  for (ModeCompare& m : modes) m.prompts += 1;
  return ok_status();
}

// The isolated pass of one prompt (compare --isolated): the reference again, chunk by chunk,
// capturing every attention layer's input, and each mode with those inputs replayed.
Status isolated_pass(std::span<const int32_t> ids, int64_t chunk, Runner& ref_runner,
                     std::vector<Runner>& runners, std::vector<ModeCompare>& modes) {
  E4KV_RETURN_IF_ERROR(ref_runner.begin());
  for (Runner& r : runners) E4KV_RETURN_IF_ERROR(r.begin());
  const int64_t n_ids = int64_t(ids.size());
  for (int64_t begin = 0; begin < n_ids; begin += chunk) {
    const std::span<const int32_t> rows =
        ids.subspan(size_t(begin), size_t(std::min(chunk, n_ids - begin)));
    CaptureProbe capture;
    capture.capture_inputs = true;
    E4KV_RETURN_IF_ERROR(ref_runner.forward(rows, begin, &capture).status());
    for (size_t m = 0; m < runners.size(); ++m) {
      ReplayProbe probe(capture, modes[m]);
      E4KV_RETURN_IF_ERROR(runners[m].forward(rows, begin, &probe).status());
    }
  }
  return ok_status();
}

// A passkey prompt of about `context` tokens: filler text with the key's sentence at `depth`
// percent, then the question. The key is 5 digits from `trial`.
struct PasskeyPrompt {
  std::vector<int32_t> ids;
  std::string key;
};
PasskeyPrompt passkey_prompt(const Tokenizer& tok, int64_t context, int64_t depth, int64_t trial) {
  const std::string key = std::to_string(10000 + (trial * 7919 + depth * 104729 + context) % 90000);
  const std::vector<int32_t> head = tok.encode(
      "There is a pass key hidden in the text below. Find it and remember it.\n", true);
  const std::vector<int32_t> filler = tok.encode(
      "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
      "again. ",
      false);
  const std::vector<int32_t> needle =
      tok.encode(" The pass key is " + key + ". Remember it. " + key + " is the pass key. ", false);
  const std::vector<int32_t> question = tok.encode("\nWhat is the pass key? The pass key is", false);
  const int64_t fixed = int64_t(head.size() + needle.size() + question.size());
  const int64_t fill = std::max<int64_t>(0, context - fixed);
  std::vector<int32_t> body;
  while (int64_t(body.size()) < fill) body.insert(body.end(), filler.begin(), filler.end());
  body.resize(size_t(fill));
  const size_t at = size_t(fill * std::clamp<int64_t>(depth, 0, 100) / 100);
  PasskeyPrompt p;
  p.key = key;
  p.ids = head;
  p.ids.insert(p.ids.end(), body.begin(), body.begin() + std::ptrdiff_t(at));
  p.ids.insert(p.ids.end(), needle.begin(), needle.end());
  p.ids.insert(p.ids.end(), body.begin() + std::ptrdiff_t(at), body.end());
  p.ids.insert(p.ids.end(), question.begin(), question.end());
  return p;
}

Status run_compare(const CompareArgs& args) {
  E4KV_RETURN_IF_ERROR(validate_model_flags(args.model));
  if (args.model.kv_cache_dtype != "fp16" || args.model.kv_scales != "calibrated") {
    return Status::error(
        "compare runs every mode itself (FP16 KV, calibrated E4M3 KV, and unit-scale E4M3 with "
        "--with-unit-control); leave --kv-cache-dtype and --kv-scales at their defaults");
  }
  if (args.prompts.empty() && args.task.empty()) {
    return Status::error("give --prompts FILE.jsonl, --task passkey, or both");
  }
  if (!args.task.empty() && args.task != "passkey") {
    return Status::error(cat("--task ", args.task, ": the one task is passkey"));
  }
  if (args.max_tokens < 0 || args.max_tokens > kMaxTokenCount) {
    return Status::error(cat("--max-tokens: expected 0 to ", kMaxTokenCount, ", got ",
                             args.max_tokens));
  }
  if (args.prefill_chunk < 1 || args.prefill_chunk > 65536) {
    return Status::error(cat("--prefill-chunk: expected 1 to 65536 rows, got ", args.prefill_chunk));
  }
  if (args.passkey_trials < 1 || args.passkey_trials > 1000) {
    return Status::error(cat("--passkey-trials: expected 1 to 1000, got ", args.passkey_trials));
  }
  // --out: its three files appear at once (calib/compare.h) and one compare writes it at a time;
  // checked before anything runs, and again once the lock is held.
  std::optional<OutputLock> out_lock;
  if (!args.out.empty()) {
    OutputRules rules;
    rules.force = args.force;
    rules.force_name = "--force";
    rules.inputs = {fs::path(args.model.model_dir)};
    if (!args.prompts.empty()) rules.inputs.emplace_back(args.prompts);
    for (int pass = 0; pass < 2; ++pass) {
      if (Status st = check_output_set_dir(args.out, kCompareFileNames, rules); !st.ok()) {
        return Status::error(cat("--out: ", st.message()));
      }
      if (pass == 1) break;
      Result<OutputLock> lock = OutputLock::acquire(lock_path_for(args.out), args.out);
      if (!lock.ok()) return Status::error(cat("--out: ", lock.message()));
      out_lock.emplace(std::move(lock).value());
    }
  }

  E4KV_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::open(args.model.model_dir));
  const int64_t vocab = ckpt.config().vocab_size;
  PromptSource source{fs::path(args.model.model_dir), args.special_tokens_in_content};
  std::vector<std::vector<int32_t>> prompts;
  if (!args.prompts.empty()) {
    E4KV_ASSIGN_OR_RETURN(const std::vector<CorpusDocument> docs, read_corpus(args.prompts));
    for (const CorpusDocument& doc : docs) {
      Result<std::vector<int32_t>> ids = source.ids(doc, vocab);
      if (!ids.ok()) return Status::error(cat(args.prompts, ":", doc.line, ": ", ids.message()));
      prompts.push_back(std::move(ids).value());
    }
  }
  // The passkey prompts, made before anything loads so that their lengths count below.
  std::vector<int64_t> contexts, depths;
  struct PasskeyCase {
    int64_t context, depth;
    PasskeyPrompt prompt;
  };
  std::vector<PasskeyCase> passkeys;
  constexpr int64_t kPasskeyTokens = 8;
  if (!args.task.empty()) {
    E4KV_ASSIGN_OR_RETURN(contexts, parse_list("--context", args.contexts, true, 1,
                                               kMaxTokenCount, "a prompt length in tokens"));
    E4KV_ASSIGN_OR_RETURN(depths, parse_list("--depths", args.depths, false, 0, 100,
                                             "a depth in percent of the prompt"));
    E4KV_ASSIGN_OR_RETURN(const Tokenizer* tok, source.tokenizer());
    for (int64_t context : contexts) {
      for (int64_t depth : depths) {
        for (int64_t trial = 0; trial < args.passkey_trials; ++trial) {
          PasskeyPrompt p = passkey_prompt(*tok, context, depth, trial);
          // The question, the key's sentence and the instructions are never cut: a shorter
          // context would be reported under a length it does not have.
          if (int64_t(p.ids.size()) > context) {
            return Status::error(cat("--context ", context, ": a passkey prompt's fixed text alone "
                                     "takes ", p.ids.size(), " tokens; give --context ",
                                     p.ids.size(), " or more"));
          }
          passkeys.push_back({context, depth, std::move(p)});
        }
      }
    }
  }
  // Positions each run needs: a teacher-forced prompt its own length; a greedy continuation of T
  // tokens after a prompt of P tokens P + T (the last token is sampled, never fed).
  int64_t need = 1;
  for (const auto& p : prompts) {
    need = std::max<int64_t>(need, int64_t(p.size()) + args.max_tokens);
  }
  for (const PasskeyCase& c : passkeys) {
    need = std::max<int64_t>(need, int64_t(c.prompt.ids.size()) + kPasskeyTokens);
  }
  const bool from_flag = args.model.max_model_len > 0;
  const int64_t max_len =
      from_flag ? args.model.max_model_len : ckpt.config().max_position_embeddings;
  if (need > max_len) {
    return Status::error(cat(
        "the longest prompt plus its continuation needs ", need, " positions; the max model "
        "length is ", max_len, from_flag ? " (--max-model-len)" : " (max_position_embeddings)",
        "; shorten the prompts, lower --max-tokens or --context, or raise --max-model-len"));
  }

  E4KV_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                        make_backend(args.model.device, args.model.threads));
  ModelOptions options;
  options.block_size = args.model.block_size;
  options.max_model_len = max_len;
  options.n_blocks = blocks_for_tokens(need, options.block_size);
  options.max_batch_tokens = std::max<int64_t>(args.prefill_chunk, 1);
  options.max_logit_rows = options.max_batch_tokens;
  options.max_seqs = 1;
  E4KV_ASSIGN_OR_RETURN(options.ple_dtype, parse_ple_dtype(args.model.ple_dtype));
  if (options.ple_dtype == PleDtype::kE4m3) options.ple_cache = std::make_shared<PleE4m3Cache>();
  Runner ref;
  E4KV_ASSIGN_OR_RETURN(ref.model, load_model(ckpt, *backend, options));
  for (const std::string& note : ref.model->load_notes()) {
    std::fprintf(stderr, "e4kv: %s\n", note.c_str());
  }
  std::vector<Runner> runners;
  CompareReport report;
  report.model = fs::path(args.model.model_dir).lexically_normal().filename().string();
  report.device = backend->name();
  report.max_tokens = args.max_tokens;
  report.isolated = args.isolated;
  report.reference.name = "fp16";
  report.reference.scales = "-";
  if (options.ple_dtype == PleDtype::kE4m3) {
    const PleTablesSummary tables = ref.model->ple_tables();
    if (tables.layers.empty()) {
      std::fprintf(stderr, "e4kv: --ple-dtype fp8_e4m3: this model has no PLE n-gram table; "
                           "nothing to store as E4M3\n");
    } else {
      PleCompare ple;
      ple.checkpoint_dtype = std::string(dtype_name(tables.checkpoint_dtype));
      ple.checkpoint_bytes = tables.checkpoint_bytes;
      ple.host_bytes = tables.host_bytes;
      for (const PleTablesSummary::Layer& l : tables.layers) {
        ple.layers.push_back({l.layer, l.n_rows, l.error.n_values, l.error.sum_sq_error,
                              l.error.sum_sq_value});
      }
      report.ple = std::move(ple);
    }
  }
  for (const KvScalesMode mode :
       {KvScalesMode::kCalibrated, KvScalesMode::kUnit}) {
    if (mode == KvScalesMode::kUnit && !args.unit_control) continue;
    ModelOptions e4m3 = options;
    e4m3.kv_cache_dtype = KvCacheDtype::kE4m3;
    e4m3.kv_scales_mode = mode;
    Runner r;
    E4KV_ASSIGN_OR_RETURN(r.model, load_model(ckpt, *backend, e4m3));
    std::fprintf(stderr, "e4kv: %s\n", r.model->kv_scales().summary.c_str());
    ModeCompare m;
    m.name = mode == KvScalesMode::kUnit ? "unit" : "e4m3";
    m.scales = mode == KvScalesMode::kUnit ? "unit (negative control)" : "calibrated";
    report.modes.push_back(std::move(m));
    runners.push_back(std::move(r));
  }

  // Teacher-forced, then free-running, prompt by prompt.
  GenerateOptions greedy;
  greedy.max_tokens = args.max_tokens;
  E4KV_ASSIGN_OR_RETURN(greedy.stop_ids, load_eos_token_ids(args.model.model_dir));
  for (const std::vector<int32_t>& ids : prompts) {
    E4KV_RETURN_IF_ERROR(teacher_forced(ids, args.prefill_chunk, ref, runners, report.reference,
                                        report.modes, vocab));
    if (args.isolated) {
      E4KV_RETURN_IF_ERROR(isolated_pass(ids, args.prefill_chunk, ref, runners, report.modes));
    }
    report.prompts += 1;
    report.teacher_forced_tokens += int64_t(ids.size());
    if (args.max_tokens == 0) continue;
    ref.sequence.reset();
    for (Runner& r : runners) r.sequence.reset();  // generate takes its own sequence
    E4KV_ASSIGN_OR_RETURN(const GenerateResult want, generate(*ref.model, ids, greedy));
    for (size_t m = 0; m < runners.size(); ++m) {
      E4KV_ASSIGN_OR_RETURN(const GenerateResult got, generate(*runners[m].model, ids, greedy));
      report.modes[m].add_greedy(got.output_ids, want.output_ids);
    }
  }
  ref.sequence.reset();
  for (Runner& r : runners) r.sequence.reset();

  if (!passkeys.empty()) {
    E4KV_ASSIGN_OR_RETURN(const Tokenizer* tok, source.tokenizer());
    GenerateOptions answer = greedy;
    answer.max_tokens = kPasskeyTokens;
    for (const PasskeyCase& c : passkeys) {
      auto correct = [&](Model& model) -> Result<bool> {
        E4KV_ASSIGN_OR_RETURN(const GenerateResult out, generate(model, c.prompt.ids, answer));
        return tok->decode(out.output_ids, true).find(c.prompt.key) != std::string::npos;
      };
      E4KV_ASSIGN_OR_RETURN(const bool ok, correct(*ref.model));
      report.reference.add_passkey(c.context, c.depth, ok);
      for (size_t m = 0; m < runners.size(); ++m) {
        E4KV_ASSIGN_OR_RETURN(const bool hit, correct(*runners[m].model));
        report.modes[m].add_passkey(c.context, c.depth, hit);
      }
    }
  }

  const std::string md = compare_markdown(report);
  std::fwrite(md.data(), 1, md.size(), stdout);
  if (!args.out.empty()) {
    E4KV_RETURN_IF_ERROR(write_compare_report(args.out, report, args.force));
    std::printf("\nwrote %s/compare.{json,md,svg}\n", args.out.c_str());
  }
  return ok_status();
}

}  // namespace

void add_compare_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand(
      "compare", "FP16 KV against calibrated E4M3 KV on the same tokens (quality measures)");
  auto args = std::make_shared<CompareArgs>();
  add_model_flags(cmd, args->model);
  cmd->add_option("--prompts", args->prompts,
                  "JSON lines: {\"text\": ...}, {\"token_ids\": [...]} or {\"messages\": [...]}");
  cmd->add_option("--max-tokens", args->max_tokens, "Greedy tokens per prompt (0: none)")
      ->transform(decimal_integer<int64_t>(0, kMaxTokenCount))
      ->capture_default_str();
  cmd->add_flag("--with-unit-control", args->unit_control,
                "Also run unit-scale E4M3 (the negative control)");
  cmd->add_option("--out", args->out,
                  "Directory for compare.json, compare.md and compare.svg, which appear at once "
                  "(built beside it, then renamed onto it); new or empty, or with --force one "
                  "holding only those files");
  cmd->add_flag("--special-tokens-in-content", args->special_tokens_in_content,
                kSpecialTokensInContentHelp);
  cmd->add_flag("--force", args->force, "Replace existing compare files in --out");
  cmd->add_option("--prefill-chunk", args->prefill_chunk,
                  "Teacher-forced rows per forward (each returns every row's logits)")
      ->transform(decimal_integer<int64_t>(1, 65536))
      ->capture_default_str();
  cmd->add_flag("--isolated", args->isolated,
                "Also measure every attention layer of the E4M3 runs on the FP16 run's inputs "
                "(the cache format's own error, none carried between layers; one more "
                "teacher-forced pass)");
  cmd->add_option("--task", args->task, "passkey: generated retrieval prompts");
  cmd->add_option("--context", args->contexts, "Passkey prompt lengths in tokens (1k = 1024)")
      ->capture_default_str();
  cmd->add_option("--depths", args->depths, "Passkey positions, percent of the prompt")
      ->capture_default_str();
  cmd->add_option("--passkey-trials", args->passkey_trials, "Prompts per (context, depth)")
      ->transform(decimal_integer<int64_t>(1, 1000))
      ->capture_default_str();
  cmd->callback([args, &result] { result = run_compare(*args); });
}

}  // namespace e4kv::cli
