// `e4kv serve MODEL`: the OpenAI-compatible server (serve/server.h) over the public engine.
//
// Start-up: the listener binds first (so /health answers 503 while the model loads), then the
// engine loads — the scale gate fails closed here: its message, exit code 1 — then one warm-up
// request runs, then /health says 200 and "e4kv serve: listening on http://HOST:PORT" goes to
// stdout. SIGTERM and SIGINT stop accepting, give the requests in flight --shutdown-timeout
// seconds, abort what is left, and exit 0.
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>

#include <unistd.h>

#include "commands.h"
#include "model_setup.h"
#include "numeric_flags.h"
#include "option_flags.h"
#ifdef E4KV_HAVE_SERVE
#include "serve/server.h"
#endif

namespace e4kv::cli {
#ifdef E4KV_HAVE_SERVE
namespace {

struct ServeArgs {
  ModelFlags model;
  serve::ServerConfig server;
  int64_t max_num_seqs = 0;
  int64_t max_num_batched_tokens = 0;
  std::string chat_template;
  bool special_tokens_in_content = false;
  double shutdown_timeout = 30.0;
  bool warmup = true;
};

int g_signal_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  (void)!::write(g_signal_pipe[1], &byte, 1);
}

Status run_serve(ServeArgs& args) {
  E4KV_RETURN_IF_ERROR(validate_model_flags(args.model));
  if (args.server.api_key.empty()) {
    if (const char* key = std::getenv("E4KV_API_KEY"); key != nullptr) args.server.api_key = key;
  }
  if (args.server.served_model_name.empty()) {
    args.server.served_model_name =
        std::filesystem::path(args.model.model_dir).lexically_normal().filename().string();
    if (args.server.served_model_name.empty()) args.server.served_model_name = args.model.model_dir;
  }
  args.server.version = E4KV_VERSION;

  // SIGTERM and SIGINT become a byte in a pipe that one thread waits on (a handler, not a blocked
  // mask: libraries start threads of their own before main, and any thread may take the signal).
  if (::pipe(g_signal_pipe) != 0) return Status::error("serve: cannot create the signal pipe");
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  serve::Server server(args.server);
  api::Result<int> port = server.bind();
  if (!port.ok()) return Status::option_error("--port", port.message());
  std::thread http([&] { server.run(); });
  std::atomic<bool> start_failed{false};
  std::thread waiter([&] {
    unsigned char sig = 0;
    while (::read(g_signal_pipe[0], &sig, 1) < 0 && errno == EINTR) {
    }
    if (!start_failed.load()) {
      std::fprintf(stderr, "e4kv serve: %s: finishing the requests in flight (at most %.0f s)\n",
                   sig == SIGTERM ? "SIGTERM" : "SIGINT", args.shutdown_timeout);
    }
    server.shutdown(args.shutdown_timeout);
  });

  api::EngineConfig config;
  config.model = args.model.model_dir;
  config.device = args.model.device;
  config.kv_cache_dtype = args.model.kv_cache_dtype;
  config.kv_scales_mode = args.model.kv_scales;
  config.ple_dtype = args.model.ple_dtype;
  config.block_size = args.model.block_size;
  config.max_model_len = args.model.max_model_len;
  config.max_num_seqs = args.max_num_seqs;
  config.max_num_batched_tokens = args.max_num_batched_tokens;
  config.enforce_eager = args.model.enforce_eager;
  config.kv_cache_memory_bytes = args.model.kv_cache_memory_bytes;
  config.num_gpu_blocks_override = args.model.num_gpu_blocks_override;
  config.gpu_memory_utilization = args.model.gpu_memory_utilization;
  config.threads = args.model.threads;
  config.tensor_parallel_size = args.model.tensor_parallel_size;
  config.special_tokens_in_content = args.special_tokens_in_content;
  config.chat_template = args.chat_template;
  LoadProgressLine progress;
  config.load_progress = progress.callback();
  api::Result<std::unique_ptr<api::LLMEngine>> engine = api::LLMEngine::create(config);
  progress.finish(engine.ok());
  auto stop_threads = [&] {
    start_failed.store(true);
    // Wakes the signal thread, which stops the listener.
    const unsigned char wake = 0;
    (void)!::write(g_signal_pipe[1], &wake, 1);
    waiter.join();
    http.join();
  };
  if (!engine.ok()) {
    stop_threads();
    // The library names its fields ("kv_cache_memory_bytes: ..."); the user typed flags.
    std::string message = engine.message();
    std::string field = engine.status().field();
    if (field.empty()) {
      for (const char* known :
           {"model", "device", "kv_cache_dtype", "kv_scales_mode", "ple_dtype", "block_size",
            "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes",
            "num_gpu_blocks_override", "gpu_memory_utilization", "threads", "tensor_parallel_size",
            "chat_template"}) {
        if (message.rfind(std::string(known) + ":", 0) == 0) field = known;
      }
    }
    if (!field.empty() && message.rfind(field + ":", 0) == 0) {
      const std::string name = field == "model" ? std::string("MODEL") : flag_for_option(field);
      message.replace(0, field.size(), name);
    }
    return Status::error(message);
  }
  for (const std::string& note : (*engine)->notes()) std::fprintf(stderr, "%s\n", note.c_str());
  if (args.warmup) {
    // One short request through every part of the step before the first client's.
    api::SamplingParams warm;
    warm.max_tokens = 2;
    api::Result<std::vector<api::Completion>> done =
        (*engine)->generate({api::Prompt(std::vector<int32_t>{0, 1})}, warm);
    if (!done.ok() || done->front().finish_reason == "error") {
      stop_threads();
      return Status::error("warm-up request failed: " +
                           (done.ok() ? done->front().error : done.message()));
    }
  }
  server.set_engine(engine->get());
  std::printf("e4kv serve: listening on http://%s:%d\n", args.server.host.c_str(), *port);
  std::fflush(stdout);
  http.join();
  waiter.join();
  engine->reset();
  std::fprintf(stderr, "e4kv serve: stopped\n");
  return ok_status();
}

}  // namespace

void add_serve_command(CLI::App& app, Status& result) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics, a "
      "chat page at /)");
  add_model_flags(cmd, args->model);
  add_pool_flags(cmd, args->model);
  cmd->add_option("--host", args->server.host, "Address to listen on (default: loopback only)")
      ->capture_default_str();
  cmd->add_option("--port", args->server.port, "Port (0: any free port)")
      ->transform(decimal_integer<int>(0, 65535))
      ->capture_default_str();
  cmd->add_option("--api-key", args->server.api_key,
                  "Every /v1 route needs 'Authorization: Bearer KEY' (or set E4KV_API_KEY)");
  cmd->add_option("--served-model-name", args->server.served_model_name,
                  "The model's name in the API (default: the directory's name)");
  cmd->add_option("--chat-template", args->chat_template,
                  "A Jinja chat template file to use instead of the checkpoint's");
  cmd->add_option("--tool-call-parser", args->server.tool_call_parser,
                  "Parse tool calls out of chat outputs: hermes (<tool_call>{...}</tool_call>)")
      ->check(CLI::IsMember({"hermes"}));
  cmd->add_option("--reasoning-parser", args->server.reasoning_parser,
                  "Return <think>...</think> as reasoning_content: qwen3")
      ->check(CLI::IsMember({"qwen3"}));
  cmd->add_option("--max-num-seqs", args->max_num_seqs, "Sequences running at once (0: 64)")
      ->transform(decimal_integer<int64_t>(0, int64_t(1) << 20));
  cmd->add_option("--max-num-batched-tokens", args->max_num_batched_tokens,
                  "Rows of one forward (0: the model's default)")
      ->transform(decimal_integer<int64_t>(0, int64_t(1) << 30));
  cmd->add_option("--max-request-bytes", args->server.max_request_bytes,
                  "Larger request bodies get 413")
      ->transform(decimal_integer<int64_t>(1024, int64_t(1) << 32))
      ->capture_default_str();
  cmd->add_option("--max-connections", args->server.max_connections,
                  "Requests handled at once; more get 429")
      ->transform(decimal_integer<int>(1, 65536))
      ->capture_default_str();
  cmd->add_option("--timeout", args->server.timeout_seconds,
                  "Socket read and write timeout in seconds (slow clients)")
      ->transform(decimal_integer<int>(1, 86400))
      ->capture_default_str();
  cmd->add_option("--shutdown-timeout", args->shutdown_timeout,
                  "Seconds the requests in flight get to finish after SIGTERM or SIGINT")
      ->transform(finite_number())
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  cmd->add_flag("--special-tokens-in-content", args->special_tokens_in_content,
                "Text in a chat message that spells a control token becomes that token");
  cmd->add_flag("!--no-warmup", args->warmup, "Skip the warm-up request before serving");
  cmd->callback([args, &result] { result = one_line(run_serve(*args)); });
}
#else
void add_serve_command(CLI::App& app, Status& result) {
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (not in this build)");
  cmd->allow_extras();
  cmd->callback([&result] {
    result = Status::error(
        "serve: this e4kv was built without cpp-httplib; install libcpp-httplib-dev (make setup "
        "does) and rebuild");
  });
}
#endif

}  // namespace e4kv::cli
