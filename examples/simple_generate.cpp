// The public C++ API in one page: load a model directory, submit three prompts from three threads,
// print each request's text as it streams in.
//
//   e4kv_example_simple MODEL_DIR [MAX_TOKENS]
//
// Output lines: "[request N] <text piece>" as pieces come, then "[request N] done: <reason>,
// <k> tokens". Pieces of different requests interleave; each request's own pieces are in order.
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <e4kv/engine.h>

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [MAX_TOKENS]\n", argv[0]);
    return 2;
  }
  e4kv::api::EngineConfig config;
  config.model = argv[1];
  auto engine = e4kv::api::LLMEngine::create(config);
  if (!engine.ok()) {
    std::fprintf(stderr, "e4kv_example_simple: error: %s\n", engine.message().c_str());
    return 1;
  }

  e4kv::api::SamplingParams params;
  params.max_tokens = argc == 3 ? std::atoll(argv[2]) : 16;
  params.ignore_eos = true;  // a small test model's EOS should not cut the demo short

  const std::vector<e4kv::api::Prompt> prompts = {
      e4kv::api::Prompt("The quick brown fox"),
      e4kv::api::Prompt(std::vector<e4kv::api::ChatMessage>{{"user", "Say hello."}}),
      e4kv::api::Prompt(std::vector<int32_t>{1, 2, 3, 4, 5}),
  };

  // Callbacks run on the engine's thread; printing is shared with nothing else but the workers'
  // error lines, so one mutex keeps lines whole.
  std::mutex print_mu;
  std::vector<std::thread> workers;
  int failures = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    workers.emplace_back([&, i] {
      // stream() hands the outputs to this thread; submit() with a callback would run the
      // printing on the engine's thread instead.
      auto stream = (*engine)->stream(prompts[i], params);
      if (!stream.ok()) {
        std::lock_guard lock(print_mu);
        std::fprintf(stderr, "prompt %zu refused: %s\n", i, stream.message().c_str());
        ++failures;
        return;
      }
      size_t n_tokens = 0;
      while (auto out = (*stream)->next()) {
        n_tokens += out->token_ids.size();
        std::lock_guard lock(print_mu);
        if (!out->text.empty()) std::printf("[request %zu] %s\n", i, out->text.c_str());
        if (out->finished) {
          std::printf("[request %zu] done: %s, %zu tokens\n", i, out->finish_reason.c_str(),
                      n_tokens);
        }
      }
    });
  }
  for (std::thread& t : workers) t.join();
  return failures == 0 ? 0 : 1;
}
