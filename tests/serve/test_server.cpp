// e4kv serve in-process on the embedded model (CPU): hostile and faulty clients get OpenAI error
// objects with the right status and the server stays up; a client that disconnects mid-stream has
// its request aborted and its blocks freed; a pool too small for the load queues and preempts but
// loses nothing; concurrent requests get exactly what they get alone; a graceful stop ends the
// streams in flight. The references are the engine alone (same prompts, greedy or seeded) and
// the engine's own counters.
#include "serve/server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace e4kv::serve {
namespace {

using json = nlohmann::ordered_json;

constexpr const char* kKey = "test-key";

api::EngineConfig engine_config() {
  api::EngineConfig c;
  c.model = std::string(E4KV_SOURCE_DIR) + "/models/tiny-qwen4exp";
  c.chat_template =
      std::string(E4KV_SOURCE_DIR) + "/tests/data/chat_templates/qwen3/template.jinja";
  c.max_model_len = 512;
  c.max_num_seqs = 8;
  c.num_gpu_blocks_override = 16;  // 1024 tokens: 8 requests of 160+ tokens (3 blocks) do not fit
  c.threads = 2;
  return c;
}

ServerConfig server_config() {
  ServerConfig c;
  c.port = 0;
  c.api_key = kKey;
  c.served_model_name = "tiny";
  c.tool_call_parser = "hermes";
  c.reasoning_parser = "qwen3";
  c.max_request_bytes = 65536;
  c.max_connections = 4;
  c.timeout_seconds = 2;
  c.version = "test";
  return c;
}

// A server on its own port over the shared engine, running on its own thread.
struct Running {
  explicit Running(api::LLMEngine* engine, ServerConfig config = server_config())
      : server(std::move(config)) {
    api::Result<int> bound = server.bind();
    EXPECT_TRUE(bound.ok()) << bound.message();
    port = bound.ok() ? *bound : 0;
    if (engine != nullptr) server.set_engine(engine);
    thread = std::thread([this] { server.run(); });
  }
  ~Running() {
    server.shutdown(0.0);
    thread.join();
  }
  httplib::Client client(bool with_key = true) const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60);
    if (with_key) c.set_default_headers({{"Authorization", std::string("Bearer ") + kKey}});
    return c;
  }
  Server server;
  int port = 0;
  std::thread thread;
};

class ServeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    api::Result<std::unique_ptr<api::LLMEngine>> e = api::LLMEngine::create(engine_config());
    ASSERT_TRUE(e.ok()) << e.message();
    engine_ = std::move(e).value().release();
  }
  static void TearDownTestSuite() {
    delete engine_;
    engine_ = nullptr;
  }
  // Waits until the engine holds no sequence and no block (the pool is back to empty).
  static bool engine_drains(std::chrono::seconds limit = std::chrono::seconds(10)) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      const api::EngineStats s = engine_->stats();
      if (s.running == 0 && s.waiting == 0 && s.kv_blocks_used == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  static api::LLMEngine* engine_;
};
api::LLMEngine* ServeTest::engine_ = nullptr;

struct Reply {
  int status = 0;
  json body;
};

Reply post(httplib::Client& c, const std::string& path, const std::string& body) {
  httplib::Result r = c.Post(path.c_str(), body, "application/json");
  if (!r) return {};
  Reply out{r->status, json::parse(r->body, nullptr, false)};
  return out;
}

// The error's param ("" when null) of a reply that must be an OpenAI error with `status`.
std::string error_param(const Reply& r, int status) {
  EXPECT_EQ(r.status, status) << r.body.dump();
  EXPECT_TRUE(r.body.contains("error")) << r.body.dump();
  if (!r.body.contains("error")) return "<no error object>";
  EXPECT_EQ(r.body["error"]["code"], status);
  EXPECT_TRUE(r.body["error"]["message"].is_string());
  return r.body["error"]["param"].is_null() ? "" : r.body["error"]["param"].get<std::string>();
}

TEST_F(ServeTest, HealthIs503UntilTheEngineIsSet) {
  Running loading(nullptr);
  httplib::Client c = loading.client();
  EXPECT_EQ(c.Get("/health")->status, 503);
  EXPECT_EQ(error_param(post(c, "/v1/completions", R"({"prompt": "x"})"), 503), "");
  loading.server.set_engine(engine_);
  EXPECT_EQ(c.Get("/health")->status, 200);
}

TEST_F(ServeTest, HostileRequestsGetErrorsAndTheServerStaysUp) {
  Running s(engine_);
  httplib::Client c = s.client();
  const std::string chat = "/v1/chat/completions", comp = "/v1/completions";
  EXPECT_EQ(error_param(post(c, comp, "{\"prompt\": "), 400), "");               // malformed
  EXPECT_EQ(error_param(post(c, comp, "[1, 2]"), 400), "");                      // not an object
  EXPECT_EQ(error_param(post(c, comp, "{\"prompt\": \"\xff\xfe\"}"), 400), "");  // bad UTF-8
  EXPECT_EQ(error_param(post(c, comp, std::string(300, '[') + std::string(300, ']')), 400), "");
  EXPECT_EQ(error_param(post(c, comp, R"({"prompt": "x", "temperature": "hot"})"), 400),
            "temperature");
  EXPECT_EQ(error_param(post(c, comp, R"({"prompt": "x", "max_tokens": -5})"), 400), "max_tokens");
  EXPECT_EQ(error_param(post(c, comp, R"({"prompt": "x", "max_tokens": 99999999999})"), 400),
            "max_tokens");
  EXPECT_EQ(error_param(post(c, comp, R"({"prompt": "x", "n": 9})"), 400), "n");  // > max_num_seqs
  EXPECT_EQ(error_param(post(c, comp, R"({"prompt": "x", "n": 1000})"), 400), "n");
  EXPECT_EQ(error_param(post(c, chat, R"({"messages": [{"role": "user", "content": "x"}],
                                          "logprobs": true, "top_logprobs": 21})"),
                        400),
            "top_logprobs");
  EXPECT_EQ(error_param(post(c, chat, R"({"messages": []})"), 400), "messages");
  EXPECT_EQ(
      error_param(post(c, chat, R"({"messages": [{"role": "pirate", "content": "x"}]})"), 400),
      "messages[0].role");
  EXPECT_EQ(error_param(post(c, chat, R"({"messages": [{"role": "user", "content": ""}],
                                          "tools": 5})"),
                        400),
            "tools");
  json long_prompt = {{"prompt", std::vector<int>(600, 7)}, {"max_tokens", 1}};
  EXPECT_EQ(error_param(post(c, comp, long_prompt.dump()), 400), "prompt");
  json outside = {{"prompt", std::vector<int>{1, 2, 1 << 30}}};
  EXPECT_EQ(error_param(post(c, comp, outside.dump()), 400), "prompt");
  EXPECT_EQ(error_param(post(c, comp, R"({"prompt": "x", "model": "gpt-4"})"), 404), "model");
  // Over --max-request-bytes.
  json big = {{"prompt", std::string(70000, 'a')}};
  httplib::Result r413 = c.Post(comp.c_str(), big.dump(), "application/json");
  ASSERT_TRUE(r413);
  EXPECT_EQ(r413->status, 413);
  EXPECT_EQ(json::parse(r413->body)["error"]["code"], 413);
  // Routes and keys.
  httplib::Result r404 = c.Get("/v1/nothing");
  ASSERT_TRUE(r404);
  EXPECT_EQ(r404->status, 404);
  EXPECT_EQ(json::parse(r404->body)["error"]["code"], 404);
  httplib::Client anonymous = s.client(false);
  EXPECT_EQ(error_param(post(anonymous, comp, R"({"prompt": "x"})"), 401), "");
  httplib::Client wrong("127.0.0.1", s.port);
  wrong.set_default_headers({{"Authorization", "Bearer test-kez"}});
  EXPECT_EQ(error_param(post(wrong, comp, R"({"prompt": "x"})"), 401), "");
  EXPECT_EQ(anonymous.Get("/health")->status, 200);  // no key needed outside /v1
  // Still serving, and nothing was left in the engine.
  Reply ok = post(c, comp, R"({"prompt": "Once upon a time", "max_tokens": 4})");
  EXPECT_EQ(ok.status, 200) << ok.body.dump();
  EXPECT_EQ(ok.body["usage"]["completion_tokens"], 4);
  EXPECT_TRUE(engine_drains());
  EXPECT_EQ(s.server.in_flight(), 0);
}

TEST_F(ServeTest, ConcurrentRequestsGetWhatTheyGetAlone) {
  // Greedy requests run one at a time through the server, then all at once with a pool that
  // must preempt: each gets the tokens it got alone, up to the first step whose top-2 logprob
  // margin alone is below 1e-3 (where batched arithmetic may pick the other token).
  const std::vector<std::string> prompts = {
      "Once upon a time",     "The cat",  "In the year 2000,",   "Hello",
      "A long time ago in a", "Water is", "The quick brown fox", "Numbers: 1, 2, 3,"};
  Running s(engine_, [] {
    ServerConfig c = server_config();
    c.max_connections = 16;
    return c;
  }());
  auto request = [&](size_t i) {
    httplib::Client c = s.client();
    json body = {{"prompt", prompts[i]},
                 {"max_tokens", 160},
                 {"ignore_eos", true},
                 {"temperature", 0.0},
                 {"logprobs", 2}};
    return post(c, "/v1/completions", body.dump());
  };
  std::vector<Reply> alone;
  for (size_t i = 0; i < prompts.size(); ++i) alone.push_back(request(i));
  const int64_t preemptions_before = engine_->stats().preemptions;
  std::vector<std::future<Reply>> replies;
  for (size_t i = 0; i < prompts.size(); ++i) {
    replies.push_back(std::async(std::launch::async, [&, i] { return request(i); }));
  }
  size_t total_compared = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    Reply r = replies[i].get();
    ASSERT_EQ(alone[i].status, 200) << alone[i].body.dump();
    ASSERT_EQ(r.status, 200) << r.body.dump();
    EXPECT_EQ(r.body["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(r.body["usage"]["completion_tokens"], 160);
    const json& a = alone[i].body["choices"][0]["logprobs"];
    const json& b = r.body["choices"][0]["logprobs"];
    ASSERT_EQ(a["tokens"].size(), 160u);
    ASSERT_EQ(b["tokens"].size(), 160u);
    size_t compared = 0;
    for (; compared < 160; ++compared) {
      std::vector<double> top;
      for (auto it = a["top_logprobs"][compared].begin(); it != a["top_logprobs"][compared].end();
           ++it) {
        top.push_back(it->get<double>());
      }
      std::sort(top.rbegin(), top.rend());
      if (top.size() >= 2 && top[0] - top[1] < 1e-3) break;
      ASSERT_EQ(b["tokens"][compared], a["tokens"][compared]) << "token " << compared;
    }
    total_compared += compared;
  }
  EXPECT_GE(total_compared, 400u) << "too few tokens compared to mean anything";
  EXPECT_GT(engine_->stats().preemptions, preemptions_before) << "the pool was meant to preempt";
  EXPECT_TRUE(engine_drains());
}

TEST_F(ServeTest, NCompletionsAreTheSeededRunsOfOnePrompt) {
  Running s(engine_);
  httplib::Client c = s.client();
  Reply r = post(c, "/v1/completions",
                 R"({"prompt": "The cat", "n": 2, "max_tokens": 10, "temperature": 1.0,
                     "seed": 5, "ignore_eos": true})");
  ASSERT_EQ(r.status, 200) << r.body.dump();
  ASSERT_EQ(r.body["choices"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    api::SamplingParams p;
    p.max_tokens = 10;
    p.temperature = 1.0;
    p.seed = 5 + i;
    p.ignore_eos = true;
    api::Result<std::vector<api::Completion>> alone = engine_->generate({"The cat"}, p);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(r.body["choices"][i]["index"], i);
    EXPECT_EQ(r.body["choices"][i]["text"], alone->front().text) << "completion " << i;
  }
  EXPECT_EQ(r.body["usage"]["completion_tokens"], 20);
}

TEST_F(ServeTest, UnseededRequestsSampleDifferently) {
  Running s(engine_);
  httplib::Client c = s.client();
  const std::string body =
      R"({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "ignore_eos": true)";
  std::set<std::string> texts;
  for (int i = 0; i < 4; ++i) {
    Reply r = post(c, "/v1/completions", body + "}");
    ASSERT_EQ(r.status, 200) << r.body.dump();
    texts.insert(r.body["choices"][0]["text"].get<std::string>());
  }
  // Four draws of 24 tokens at temperature 1 from the same seed would be one text.
  EXPECT_GT(texts.size(), 1u);
  // A seed makes them equal.
  Reply a = post(c, "/v1/completions", body + R"(, "seed": 9})");
  Reply b = post(c, "/v1/completions", body + R"(, "seed": 9})");
  EXPECT_EQ(a.body["choices"][0]["text"], b.body["choices"][0]["text"]);
}

// Reads a stream; `keep_reading(chunks so far)` false drops the connection.
std::vector<json> read_stream(httplib::Client& c, const std::string& path, const std::string& body,
                              const std::function<bool(size_t)>& keep_reading,
                              bool* saw_done = nullptr, int* status = nullptr) {
  std::vector<json> events;
  std::string buffer;
  bool done = false;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body;
  req.set_header("Content-Type", "application/json");
  req.set_header("Authorization", std::string("Bearer ") + kKey);
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    size_t end;
    while ((end = buffer.find("\n\n")) != std::string::npos) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string payload = event.substr(6);
      if (payload == "[DONE]") {
        done = true;
      } else {
        events.push_back(json::parse(payload));
      }
    }
    return keep_reading(events.size());
  };
  httplib::Result r = c.send(req);
  if (status != nullptr) *status = r ? r->status : 0;
  if (saw_done != nullptr) *saw_done = done;
  return events;
}

TEST_F(ServeTest, StreamWithUsageMatchesTheWholeAnswer) {
  Running s(engine_);
  httplib::Client c = s.client();
  const std::string body = R"({"messages": [{"role": "user", "content": "Tell me a story"}],
                               "max_tokens": 12, "min_tokens": 12, "temperature": 0})";
  Reply whole = post(c, "/v1/chat/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body.dump();
  json streamed_body = json::parse(body);
  streamed_body["stream"] = true;
  streamed_body["stream_options"] = {{"include_usage", true}};
  bool done = false;
  std::vector<json> events = read_stream(
      c, "/v1/chat/completions", streamed_body.dump(), [](size_t) { return true; }, &done);
  ASSERT_TRUE(done);
  ASSERT_GE(events.size(), 2u);
  std::string content, reasoning;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    EXPECT_EQ(events[i]["object"], "chat.completion.chunk");
    EXPECT_EQ(events[i]["id"], events[0]["id"]);
    const json& delta = events[i]["choices"][0]["delta"];
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (delta.contains("reasoning_content"))
      reasoning += delta["reasoning_content"].get<std::string>();
  }
  EXPECT_EQ(events[0]["choices"][0]["delta"]["role"], "assistant");
  const json& usage_event = events.back();
  EXPECT_TRUE(usage_event["choices"].empty());
  EXPECT_EQ(usage_event["usage"], whole.body["usage"]);
  const json& message = whole.body["choices"][0]["message"];
  EXPECT_EQ(content, message["content"].is_null() ? "" : message["content"].get<std::string>());
  EXPECT_EQ(reasoning, message["reasoning_content"].is_null()
                           ? ""
                           : message["reasoning_content"].get<std::string>());
  EXPECT_EQ(events[events.size() - 2]["choices"][0]["finish_reason"],
            whole.body["choices"][0]["finish_reason"]);
}

TEST_F(ServeTest, DisconnectMidStreamAbortsAndFreesAtOnce) {
  Running s(engine_);
  httplib::Client c = s.client();
  std::vector<json> events = read_stream(
      c, "/v1/completions",
      R"({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true, "stream": true})",
      [](size_t n) { return n < 3; });
  EXPECT_GE(events.size(), 3u);
  EXPECT_TRUE(engine_drains(std::chrono::seconds(5)))
      << "blocks in use: " << engine_->stats().kv_blocks_used;
  // The server is fine afterwards.
  Reply ok = post(c, "/v1/completions", R"({"prompt": "x", "max_tokens": 2})");
  EXPECT_EQ(ok.status, 200);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (s.server.in_flight() != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(s.server.in_flight(), 0);
}

TEST_F(ServeTest, MoreConnectionsThanTheLimitGet429) {
  Running s(engine_);  // max_connections 4
  std::atomic<bool> release{false};
  std::atomic<int> streaming{0};
  std::vector<std::thread> holders;
  for (int i = 0; i < 4; ++i) {
    holders.emplace_back([&] {
      httplib::Client c = s.client();
      bool counted = false;
      read_stream(c, "/v1/completions",
                  R"({"prompt": "Hello", "max_tokens": 300, "ignore_eos": true, "stream": true})",
                  [&](size_t n) {
                    if (n > 0 && !counted) {
                      counted = true;
                      streaming.fetch_add(1);
                    }
                    while (!release.load())
                      std::this_thread::sleep_for(std::chrono::milliseconds(5));
                    return false;
                  });
    });
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (streaming.load() < 4 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(streaming.load(), 4);
  httplib::Client extra = s.client();
  EXPECT_EQ(error_param(post(extra, "/v1/completions", R"({"prompt": "x"})"), 429), "");
  release.store(true);
  for (std::thread& t : holders) t.join();
  EXPECT_TRUE(engine_drains());
  Reply ok = post(extra, "/v1/completions", R"({"prompt": "x", "max_tokens": 2})");
  EXPECT_EQ(ok.status, 200) << ok.body.dump();
}

TEST_F(ServeTest, SlowClientIsCutOffAndOthersAreServed) {
  Running s(engine_);  // timeout 2 s
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(s.port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string partial =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: 100\r\n\r\n{\"prompt\"";
  ASSERT_EQ(::send(fd, partial.data(), partial.size(), 0), ssize_t(partial.size()));
  // Meanwhile another client is served.
  httplib::Client c = s.client();
  Reply ok = post(c, "/v1/completions", R"({"prompt": "x", "max_tokens": 2})");
  EXPECT_EQ(ok.status, 200);
  // The stalled one is closed after the read timeout (recv sees the end, or an error reply).
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  const auto t0 = std::chrono::steady_clock::now();
  char buf[4096];
  ssize_t n = 0;
  std::string got;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) got.append(buf, size_t(n));
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  EXPECT_EQ(n, 0) << "the server did not close the stalled connection";
  EXPECT_LT(waited, 8.0);
  EXPECT_EQ(c.Get("/health")->status, 200);
}

TEST_F(ServeTest, GracefulStopEndsTheStreamsInFlight) {
  auto running = std::make_unique<Running>(engine_);
  httplib::Client c = running->client();
  std::atomic<bool> started{false};
  bool done = false;
  std::vector<json> events;
  std::thread client([&] {
    events = read_stream(
        c, "/v1/completions",
        R"({"prompt": "Hello", "max_tokens": 480, "ignore_eos": true, "stream": true})",
        [&](size_t n) {
          if (n > 0) started.store(true);
          return true;
        },
        &done);
  });
  while (!started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  running->server.shutdown(0.1);  // too short for 480 tokens: the stream is aborted
  client.join();
  running->thread.join();
  running->thread = std::thread([] {});
  EXPECT_TRUE(done);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "abort");
  EXPECT_TRUE(engine_drains());
  running.reset();
}

TEST_F(ServeTest, TokenizeRendersTheChatWithTools) {
  Running s(engine_);
  httplib::Client c = s.client();
  const std::string messages = R"([{"role": "user", "content": "weather in Oslo?"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "minus four degrees"}])";
  const std::string tools =
      R"([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  Reply t = post(c, "/tokenize", R"({"messages": )" + messages + R"(, "tools": )" + tools + "}");
  ASSERT_EQ(t.status, 200) << t.body.dump();
  EXPECT_EQ(t.body["count"], t.body["tokens"].size());
  Reply d = post(c, "/detokenize", json{{"tokens", t.body["tokens"]}}.dump());
  ASSERT_EQ(d.status, 200);
  const std::string text = d.body["prompt"];
  EXPECT_NE(text.find("get_weather"), std::string::npos);
  EXPECT_NE(text.find("Weather now"), std::string::npos);
  EXPECT_NE(text.find("minus four degrees"), std::string::npos);
  // The same chat through /v1/chat/completions counts the same prompt tokens.
  Reply chat =
      post(c, "/v1/chat/completions",
           R"({"messages": )" + messages + R"(, "tools": )" + tools + R"(, "max_tokens": 1})");
  ASSERT_EQ(chat.status, 200) << chat.body.dump();
  EXPECT_EQ(chat.body["usage"]["prompt_tokens"], t.body["count"]);
  EXPECT_EQ(error_param(post(c, "/detokenize", R"({"tokens": [-1]})"), 400), "tokens");
  EXPECT_EQ(error_param(post(c, "/tokenize", R"({"nothing": 1})"), 400), "");
}

TEST_F(ServeTest, MetricsFollowTheEngine) {
  Running s(engine_);
  httplib::Client c = s.client();
  Reply ok = post(c, "/v1/completions", R"({"prompt": "Hello", "max_tokens": 3})");
  ASSERT_EQ(ok.status, 200);
  httplib::Result m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  const api::EngineStats stats = engine_->stats();
  EXPECT_NE(m->body.find("e4kv:kv_cache_blocks_total{model_name=\"tiny\"} " +
                         std::to_string(stats.kv_blocks_total)),
            std::string::npos);
  EXPECT_NE(m->body.find("e4kv:generation_tokens_total{model_name=\"tiny\"} " +
                         std::to_string(stats.generation_tokens)),
            std::string::npos);
  EXPECT_NE(m->body.find("kv_cache_dtype=\"fp16\",scales=\"none\""), std::string::npos);
  EXPECT_NE(m->body.find("e4kv:time_to_first_token_seconds_count{model_name=\"tiny\"} 1"),
            std::string::npos)
      << m->body;
  // Finished requests are counted once per request, also with n completions.
  const std::string length_series =
      "e4kv:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} ";
  auto count_length = [&] {
    const std::string body = c.Get("/metrics")->body;
    const size_t at = body.find(length_series);
    return at == std::string::npos ? -1 : std::atoi(body.c_str() + at + length_series.size());
  };
  const int before = count_length();
  Reply two = post(c, "/v1/completions",
                   R"({"prompt": "Hello", "max_tokens": 3, "n": 2, "ignore_eos": true})");
  ASSERT_EQ(two.status, 200) << two.body.dump();
  EXPECT_EQ(count_length(), before + 1);
}

}  // namespace
}  // namespace e4kv::serve
