#include "serve/server.h"

#include <httplib.h>

#include <chrono>
#include <ctime>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "core/json.h"
#include "serve/openai_protocol.h"
#include "serve/page_assets.h"

namespace e4kv::serve {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

void send_error(httplib::Response& res, const ApiError& error) {
  res.status = error.status;
  res.set_content(to_text(error_body(error)), "application/json");
}

void send_json(httplib::Response& res, const json& body) {
  res.status = 200;
  res.set_content(to_text(body), "application/json");
}

// Equal strings in time that depends only on their lengths (the API key check).
bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::string& other = a.size() == b.size() ? b : a;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ other[i]);
  return diff == 0;
}

// A request body as JSON: 400 when it is not (nesting bounded, invalid UTF-8 refused).
std::optional<json> body_json(const httplib::Request& req, httplib::Response& res) {
  Result<json> parsed = parse_ordered_json(req.body, "request body");
  if (!parsed.ok()) {
    send_error(res, ApiError{400, parsed.message(), ""});
    return std::nullopt;
  }
  return std::move(parsed).value();
}

// One request's outputs on their way from the engine's loop to the HTTP thread.
struct Exchange {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<api::CompletionOutput> queue;
  bool finished = false;  // the request's last output was queued

  void push(const api::CompletionOutput& out) {
    {
      std::lock_guard lock(mu);
      queue.push_back(out);
      if (out.request_finished) finished = true;
    }
    cv.notify_one();
  }
  // Waits up to `wait` for outputs; takes them all.
  std::vector<api::CompletionOutput> take(std::chrono::milliseconds wait) {
    std::unique_lock lock(mu);
    cv.wait_for(lock, wait, [&] { return !queue.empty(); });
    std::vector<api::CompletionOutput> out(std::make_move_iterator(queue.begin()),
                                           std::make_move_iterator(queue.end()));
    queue.clear();
    return out;
  }
};

// The latency figures of one request, observed on the HTTP thread.
struct Timing {
  Clock::time_point arrival;
  std::optional<Clock::time_point> last_token;
  bool first = true;
};

// The state of one generation request shared by its handler, its stream provider and the
// engine's callback.
struct Generation {
  bool chat = false;
  ParsedRequest parsed;
  std::string id;
  int64_t created = 0;
  std::string model;
  api::RequestId engine_id = 0;
  std::shared_ptr<Exchange> exchange = std::make_shared<Exchange>();
  std::map<int32_t, ChoiceBuilder> choices;
  OutputParsing parsing;
  api::Usage usage;
  Timing timing;
  double queue_seconds = -1;
  bool done = false;

  ChoiceBuilder& choice(int32_t index) {
    auto it = choices.find(index);
    if (it == choices.end()) {
      it = choices
               .emplace(index, ChoiceBuilder(chat ? Endpoint::kChat : Endpoint::kCompletions, index,
                                             parsing, parsed.logprobs))
               .first;
    }
    return it->second;
  }
  json envelope(const char* object) const {
    return {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
  }
};

}  // namespace

Server::Server(ServerConfig config)
    : config_(std::move(config)),
      http_(std::make_unique<httplib::Server>()),
      metrics_(config_.served_model_name) {
  const size_t threads = size_t(std::max(config_.max_connections, 1)) + 8;
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http_->set_payload_max_length(size_t(config_.max_request_bytes));
  http_->set_read_timeout(config_.timeout_seconds);
  http_->set_write_timeout(config_.timeout_seconds);
  http_->set_keep_alive_timeout(5);
  install_routes();
}

Server::~Server() = default;

api::Result<int> Server::bind() {
  int port = config_.port;
  if (port == 0) {
    port = http_->bind_to_any_port(config_.host);
    if (port < 0) port = 0;
  } else if (!http_->bind_to_port(config_.host, port)) {
    port = 0;
  }
  if (port <= 0) {
    return api::Status::error(config_.host + ":" + std::to_string(config_.port) +
                                  ": cannot listen there (in use, or not an address of this "
                                  "machine); pick another --host or --port",
                              "port");
  }
  return port;
}

void Server::run() {
  http_->listen_after_bind();
}

void Server::set_engine(api::LLMEngine* engine) {
  engine_.store(engine);
}

int64_t Server::in_flight() const {
  std::lock_guard lock(mu_);
  return int64_t(in_flight_.size());
}

void Server::remove_in_flight(api::RequestId id) {
  {
    std::lock_guard lock(mu_);
    in_flight_.erase(id);
  }
  cv_.notify_all();
}

void Server::shutdown(double timeout_seconds) {
  draining_.store(true);
  {
    // Done when no request is in the engine and every response was written (the listener's stop
    // cuts the streams still being written).
    auto idle = [&] { return in_flight_.empty() && active_.load() == 0; };
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::duration<double>(std::max(timeout_seconds, 0.0)), idle);
    if (!in_flight_.empty()) {
      if (api::LLMEngine* engine = engine_.load()) {
        for (api::RequestId id : in_flight_) engine->abort(id);
      }
    }
    // The aborted requests' final outputs reach their clients.
    cv_.wait_for(lock, std::chrono::seconds(10), idle);
  }
  http_->stop();
}

void Server::refresh_engine_metrics() {
  api::LLMEngine* engine = engine_.load();
  if (engine == nullptr) return;
  const api::EngineStats s = engine->stats();
  EngineSnapshot snap;
  snap.running = s.running;
  snap.waiting = s.waiting;
  snap.kv_blocks_used = s.kv_blocks_used;
  snap.kv_blocks_total = s.kv_blocks_total;
  snap.block_size = s.block_size;
  snap.pool_tokens = s.kv_pool_tokens;
  snap.fp16_equivalent_tokens = s.kv_fp16_equivalent_tokens;
  snap.preemptions_total = s.preemptions;
  snap.prompt_tokens_total = s.prompt_tokens;
  snap.generation_tokens_total = s.generation_tokens;
  snap.kv_nonfinite_inputs_total = s.kv_nonfinite_inputs;
  snap.kv_cache_dtype = s.kv_cache_dtype;
  snap.scales = s.kv_scales;
  metrics_.set_engine_state(snap);
}

// The per-connection flag that this request was counted against max_connections (a connection's
// requests are handled one after another on one pool thread).
thread_local bool t_counted = false;

void Server::install_routes() {
  httplib::Server& http = *http_;

  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (active_.fetch_add(1) >= config_.max_connections) {
      active_.fetch_sub(1);
      send_error(res, ApiError{429,
                               "too many requests in flight (the server's --max-connections is " +
                                   std::to_string(config_.max_connections) + "); retry later",
                               ""});
      return httplib::Server::HandlerResponse::Handled;
    }
    t_counted = true;
    const bool v1 = req.path.rfind("/v1/", 0) == 0;
    if (v1 && !config_.api_key.empty()) {
      const std::string header = req.get_header_value("Authorization");
      const std::string expected = "Bearer " + config_.api_key;
      if (!constant_time_equal(header, expected)) {
        send_error(res,
                   ApiError{401, "a valid API key is required (Authorization: Bearer KEY)", ""});
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // After the response was written (streams included).
  http.set_logger([this](const httplib::Request&, const httplib::Response&) {
    if (t_counted) {
      t_counted = false;
      {
        std::lock_guard lock(mu_);
        active_.fetch_sub(1);
      }
      cv_.notify_all();
    }
  });
  http.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        std::string message;
        switch (res.status) {
          case 404:
            message = "no route " + req.method + " " + req.path;
            break;
          case 413:
            message = "the request body is larger than the server's --max-request-bytes";
            break;
          case 405:
            message = "method not allowed";
            break;
          default:
            message = "the request could not be handled (HTTP " + std::to_string(res.status) + ")";
        }
        send_error(res, ApiError{res.status, message, ""});
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = std::string("internal error: ") + e.what();
        } catch (...) {
        }
        send_error(res, ApiError{500, what, ""});
      });

  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (engine_.load() == nullptr || draining_.load()) {
      send_error(res, ApiError{503, draining_.load() ? "shutting down" : "loading", ""});
      return;
    }
    send_json(res, json::object());
  });
  http.Get("/version", [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, {{"version", config_.version}});
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    api::LLMEngine* engine = engine_.load();
    json model = {{"id", config_.served_model_name},
                  {"object", "model"},
                  {"created", int64_t(std::time(nullptr))},
                  {"owned_by", "e4kv"}};
    if (engine != nullptr) model["max_model_len"] = engine->max_model_len();
    send_json(res, {{"object", "list"}, {"data", json::array({model})}});
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    refresh_engine_metrics();
    res.set_content(metrics_.render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(false, req, res);
  });
  http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generate(true, req, res);
  });
  http.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    handle_tokenize(req, res);
  });
  http.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    handle_detokenize(req, res);
  });
  auto page = [](const httplib::Request& req, httplib::Response& res) {
    const PageAsset* asset = find_page_asset(req.path == "/" ? "/index.html" : req.path);
    if (asset == nullptr) {
      send_error(res, ApiError{404, "no page " + req.path, ""});
      return;
    }
    res.set_content(reinterpret_cast<const char*>(asset->data), asset->size, asset->content_type);
  };
  http.Get("/", page);
  http.Get(R"(/[A-Za-z0-9_\-]+\.(html|js|css|svg))", page);
}

void Server::handle_tokenize(const httplib::Request& req, httplib::Response& res) {
  api::LLMEngine* engine = engine_.load();
  if (engine == nullptr) return send_error(res, ApiError{503, "the model is loading", ""});
  std::optional<json> body = body_json(req, res);
  if (!body) return;
  if (!body->is_object()) return send_error(res, ApiError{400, "the body must be an object", ""});
  bool add_special_tokens = true;
  std::optional<api::Prompt> prompt;
  json rest = *body;
  if (auto it = rest.find("add_special_tokens"); it != rest.end()) {
    if (!it->is_boolean()) {
      return send_error(
          res, ApiError{400, "add_special_tokens: must be a boolean", "add_special_tokens"});
    }
    add_special_tokens = it->get<bool>();
    rest.erase(it);
  }
  if (rest.contains("prompt")) {
    if (!rest["prompt"].is_string()) {
      return send_error(res, ApiError{400, "prompt: must be a string", "prompt"});
    }
    prompt.emplace(rest["prompt"].get<std::string>());
    rest.erase("prompt");
  } else if (rest.contains("messages")) {
    // The chat fields as /v1/chat/completions checks them.
    json chat = rest;
    ParsedRequest parsed;
    ProtocolLimits limits;
    limits.max_model_len = engine->max_model_len();
    if (std::optional<ApiError> err = parse_request(Endpoint::kChat, chat, limits, &parsed)) {
      return send_error(res, *err);
    }
    prompt = parsed.prompt;
    rest = json::object();
  } else {
    return send_error(res, ApiError{400, "give \"prompt\" (text) or \"messages\" (a chat)", ""});
  }
  for (auto it = rest.begin(); it != rest.end(); ++it) {
    if (it.key() != "model") {
      return send_error(res, ApiError{400, it.key() + ": unknown or unsupported field", it.key()});
    }
  }
  api::Result<std::vector<int32_t>> ids = engine->tokenize(*prompt, add_special_tokens);
  if (!ids.ok()) return send_error(res, ApiError{400, ids.message(), ids.status().field()});
  send_json(res,
            {{"count", ids->size()}, {"max_model_len", engine->max_model_len()}, {"tokens", *ids}});
}

void Server::handle_detokenize(const httplib::Request& req, httplib::Response& res) {
  api::LLMEngine* engine = engine_.load();
  if (engine == nullptr) return send_error(res, ApiError{503, "the model is loading", ""});
  std::optional<json> body = body_json(req, res);
  if (!body) return;
  if (!body->is_object() || !body->contains("tokens") || !(*body)["tokens"].is_array()) {
    return send_error(res, ApiError{400, "tokens: required (an array of token ids)", "tokens"});
  }
  std::vector<int32_t> ids;
  for (const json& t : (*body)["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
        t.get<int64_t>() >= engine->vocab_size()) {
      return send_error(res, ApiError{400,
                                      "tokens: each must be a token id in [0, " +
                                          std::to_string(engine->vocab_size()) + ")",
                                      "tokens"});
    }
    ids.push_back(int32_t(t.get<int64_t>()));
  }
  api::Result<std::string> text = engine->decode(ids, /*skip_special_tokens=*/false);
  if (!text.ok()) return send_error(res, ApiError{400, text.message(), ""});
  send_json(res, {{"prompt", *text}});
}

void Server::handle_generate(bool chat, const httplib::Request& req, httplib::Response& res) {
  const Clock::time_point arrival = Clock::now();
  api::LLMEngine* engine = engine_.load();
  if (engine == nullptr || draining_.load()) {
    return send_error(
        res,
        ApiError{503, engine == nullptr ? "the model is loading" : "the server is shutting down",
                 ""});
  }
  std::optional<json> body = body_json(req, res);
  if (!body) return;
  auto gen = std::make_shared<Generation>();
  gen->chat = chat;
  gen->timing.arrival = arrival;
  ProtocolLimits limits;
  limits.max_model_len = engine->max_model_len();
  if (std::optional<ApiError> err = parse_request(chat ? Endpoint::kChat : Endpoint::kCompletions,
                                                  *body, limits, &gen->parsed)) {
    return send_error(res, *err);
  }
  ParsedRequest& parsed = gen->parsed;
  if (!parsed.model.empty() && parsed.model != config_.served_model_name) {
    return send_error(res, ApiError{404,
                                    "the model \"" + parsed.model +
                                        "\" does not exist here; this "
                                        "server serves \"" +
                                        config_.served_model_name + "\"",
                                    "model"});
  }
  if (parsed.parse_tool_calls && config_.tool_call_parser.empty()) {
    return send_error(res, ApiError{400,
                                    "tool_choice: \"auto\" needs the server started with "
                                    "--tool-call-parser (or send tool_choice \"none\")",
                                    "tool_choice"});
  }
  api::Result<std::vector<int32_t>> ids =
      engine->tokenize(parsed.prompt, parsed.add_special_tokens);
  if (!ids.ok()) return send_error(res, ApiError{400, ids.message(), ids.status().field()});
  const int64_t n_prompt = int64_t(ids->size());
  if (!parsed.max_tokens_given && chat) {
    parsed.params.max_tokens = std::max<int64_t>(engine->max_model_len() - n_prompt, 0);
  }
  if (!parsed.seed_given) {
    // An unseeded request samples differently each time, as OpenAI's and vLLM's do.
    thread_local std::mt19937_64 seeds{std::random_device{}()};
    parsed.params.seed = seeds();
  }
  gen->parsing.tool_calls = parsed.parse_tool_calls && config_.tool_call_parser == "hermes";
  gen->parsing.reasoning = chat && config_.reasoning_parser == "qwen3";
  if (gen->parsing.reasoning) {
    // Whether the generation prompt already opened the think block.
    const size_t tail = std::min<size_t>(ids->size(), 8);
    std::vector<int32_t> last(ids->end() - std::ptrdiff_t(tail), ids->end());
    api::Result<std::string> text = engine->decode(last, /*skip_special_tokens=*/false);
    gen->parsing.reasoning_opened = text.ok() && prompt_opens_reasoning(*text);
  }
  gen->id = make_response_id(chat ? "chatcmpl-" : "cmpl-");
  gen->created = int64_t(std::time(nullptr));
  gen->model = config_.served_model_name;

  std::shared_ptr<Exchange> exchange = gen->exchange;
  {
    // Under mu_ so that a request finishing at once leaves in_flight_ after it entered it.
    std::lock_guard lock(mu_);
    api::Result<api::RequestId> submitted =
        engine->submit(api::Prompt(std::move(ids).value()), parsed.params,
                       [this, exchange](const api::CompletionOutput& out) {
                         // Counted here, where every request's last output arrives (also a
                         // dropped stream's "abort"): once per request, by its last reason.
                         // It leaves in_flight_ before its handler can answer, so a client
                         // never sees its answer while the server still counts it (shutdown
                         // also waits for the handlers themselves: active_).
                         if (out.request_finished) {
                           metrics_.count_finished(out.finish_reason);
                           remove_in_flight(out.request_id);
                         }
                         exchange->push(out);
                       });
    if (!submitted.ok()) {
      return send_error(res, ApiError{400, submitted.message(), submitted.status().field()});
    }
    gen->engine_id = *submitted;
    in_flight_.insert(gen->engine_id);
  }

  // Takes the engine's outputs into the choices; `emit` gets each stream chunk's choices.
  auto absorb = [this, gen](const std::vector<api::CompletionOutput>& outs,
                            const std::function<void(std::vector<json> &&)>& emit) {
    for (const api::CompletionOutput& out : outs) {
      if (!out.token_ids.empty()) {
        const Clock::time_point now = Clock::now();
        if (gen->timing.first) {
          metrics_.observe_ttft(seconds(now - gen->timing.arrival));
          gen->timing.first = false;
        } else if (gen->timing.last_token) {
          metrics_.observe_inter_token(seconds(now - *gen->timing.last_token));
        }
        gen->timing.last_token = now;
      }
      gen->usage = out.usage;
      ChoiceBuilder& choice = gen->choice(out.index);
      if (emit) {
        emit(choice.stream_choices(out));
      } else {
        choice.add(out);
      }
      if (out.request_finished) {
        gen->done = true;
        gen->queue_seconds = out.queue_seconds;
        metrics_.observe_e2e(seconds(Clock::now() - gen->timing.arrival));
        if (out.queue_seconds >= 0) metrics_.observe_queue_time(out.queue_seconds);
      }
    }
  };

  if (!parsed.stream) {
    while (!gen->done) absorb(exchange->take(std::chrono::milliseconds(200)), nullptr);
    // A request the engine ended with an error: no partial answer.
    for (const auto& [index, choice] : gen->choices) {
      if (choice.finish_reason() == "error") {
        const bool before_output = gen->usage.completion_tokens == 0;
        return send_error(res, ApiError{before_output ? 400 : 500, choice.error(), ""});
      }
    }
    json response = gen->envelope(chat ? "chat.completion" : "text_completion");
    json choices = json::array();
    for (int32_t i = 0; i < int32_t(parsed.params.n); ++i)
      choices.push_back(gen->choice(i).whole_choice());
    response["choices"] = std::move(choices);
    response["usage"] = usage_json(gen->usage);
    return send_json(res, response);
  }

  const char* chunk_object = chat ? "chat.completion.chunk" : "text_completion";
  res.set_header("Cache-Control", "no-cache");
  auto provide = [this, gen, absorb, chunk_object, engine](httplib::DataSink& sink) -> bool {
    auto write_event = [&](const json& event) {
      const std::string line = "data: " + to_text(event) + "\n\n";
      return sink.write(line.data(), line.size());
    };
    bool ok = true;
    std::string error;
    auto emit = [&](std::vector<json>&& choices) {
      for (json& c : choices) {
        if (c.value("finish_reason", json()).is_string() &&
            c["finish_reason"].get<std::string>() == "error") {
          error = gen->choice(c["index"].get<int32_t>()).error();
          continue;
        }
        json event = gen->envelope(chunk_object);
        event["choices"] = json::array({std::move(c)});
        if (ok && !write_event(event)) ok = false;
      }
    };
    std::vector<api::CompletionOutput> outs = gen->exchange->take(std::chrono::milliseconds(100));
    if (outs.empty() && !gen->done) {
      if (!sink.is_writable()) ok = false;
    } else {
      absorb(outs, emit);
    }
    if (!ok) {
      // The client went away: its request leaves the engine now.
      engine->abort(gen->engine_id);
      return false;
    }
    if (!gen->done) return true;
    if (!error.empty()) {
      write_event(error_body(ApiError{500, error, ""}));
    }
    if (gen->parsed.include_usage) {
      json event = gen->envelope(chunk_object);
      event["choices"] = json::array();
      event["usage"] = usage_json(gen->usage);
      write_event(event);
    }
    const std::string done = "data: [DONE]\n\n";
    sink.write(done.data(), done.size());
    sink.done();
    return true;
  };
  res.set_chunked_content_provider(
      "text/event-stream",
      [provide, gen, engine](size_t, httplib::DataSink& sink) {
        // Nothing in a stream may take the server down: a failure ends this stream only.
        try {
          return provide(sink);
        } catch (...) {
          engine->abort(gen->engine_id);
          return false;
        }
      },
      [gen, engine](bool) {
        // Released on success and on a dropped connection alike: a request still running is
        // aborted (its final output still arrives, and is dropped with the exchange).
        if (!gen->done) engine->abort(gen->engine_id);
      });
}

}  // namespace e4kv::serve
