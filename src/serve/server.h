// `e4kv serve`: an OpenAI-compatible HTTP server over one LLMEngine (include/e4kv/engine.h), on
// cpp-httplib.
//
// Threads. HTTP threads (a pool of max_connections + a few, so that a client over the limit still
// gets its 429) parse, check, tokenize, submit to the engine and stream; they never touch the
// model. The engine's loop thread runs every forward and hands each output to the request's
// queue. A client that goes away mid-stream has its request aborted at the next write (its
// sequence leaves the batch and its blocks return to the pool).
//
// Routes and error bodies are OpenAI's and vLLM's (serve/openai_protocol.h): /v1/completions,
// /v1/chat/completions (both streamed as server-sent events on request), /v1/models, /tokenize,
// /detokenize, /health, /version, /metrics and the chat page at /.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>

#include "e4kv/engine.h"
#include "serve/metrics.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace e4kv::serve {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (bind() says which)
  // Every /v1 route needs "Authorization: Bearer <api_key>" when set.
  std::string api_key;
  std::string served_model_name;                  // the model's id in /v1/models and responses
  std::string tool_call_parser;                   // "" or "hermes"
  std::string reasoning_parser;                   // "" or "qwen3"
  int64_t max_request_bytes = int64_t(16) << 20;  // larger bodies: 413
  int max_connections = 256;                      // requests in flight at once; more: 429
  int timeout_seconds = 300;                      // socket read and write timeouts (slow clients)
  std::string version;
};

class Server {
 public:
  explicit Server(ServerConfig config);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; the port bound (config.port, or the one picked for 0). Errors:
  // the address cannot be bound.
  api::Result<int> bind();
  // Serves until stop() (call from another thread); bind() first. Before set_engine(), /health
  // and the /v1 routes answer 503.
  void run();

  // The engine to serve, once loaded and warmed up: /health says 200 from here on. It must
  // outlive the server.
  void set_engine(api::LLMEngine* engine);

  // Graceful stop: new /v1 requests get 503; requests in flight get `timeout_seconds` to finish,
  // then are aborted (their clients get finish_reason "abort"); then the listener stops and run()
  // returns. Any thread; returns when done.
  void shutdown(double timeout_seconds);

  // Requests submitted to the engine and not yet finished.
  int64_t in_flight() const;

 private:
  void install_routes();
  void handle_generate(bool chat, const httplib::Request& req, httplib::Response& res);
  void handle_tokenize(const httplib::Request& req, httplib::Response& res);
  void handle_detokenize(const httplib::Request& req, httplib::Response& res);
  void refresh_engine_metrics();
  void remove_in_flight(api::RequestId id);

  ServerConfig config_;
  std::unique_ptr<httplib::Server> http_;
  std::atomic<api::LLMEngine*> engine_{nullptr};
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> active_{0};  // requests being handled (the connection limit)
  ServerMetrics metrics_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_set<api::RequestId> in_flight_;  // under mu_
};

}  // namespace e4kv::serve
