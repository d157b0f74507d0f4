#include "serve/openai_protocol.h"

#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <string_view>

namespace e4kv::serve {
namespace {

std::string error_type(int status) {
  switch (status) {
    case 400:
      return "BadRequestError";
    case 401:
      return "AuthenticationError";
    case 404:
      return "NotFoundError";
    case 405:
      return "MethodNotAllowedError";
    case 413:
      return "RequestTooLargeError";
    case 429:
      return "RateLimitError";
    case 503:
      return "ServiceUnavailableError";
    default:
      return status >= 500 ? "InternalServerError" : "BadRequestError";
  }
}

std::string type_name(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

ApiError bad(const std::string& field, const std::string& detail) {
  return ApiError{400, field + ": " + detail, field};
}

// Field readers: an absent or null field leaves the value; a present one of the wrong type or
// out of range is an error naming it.
class Fields {
 public:
  explicit Fields(const json& body) : body_(body) {}

  const json* get(const std::string& name) {
    seen_.insert(name);
    auto it = body_.find(name);
    if (it == body_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  bool number(const std::string& name, double lo, double hi, double* out) {
    const json* v = get(name);
    if (v == nullptr) return true;
    if (!v->is_number()) return fail(name, "must be a number, got " + type_name(*v));
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi) {
      return fail(name, "must be in [" + fmt(lo) + ", " + fmt(hi) + "], got " + v->dump());
    }
    *out = x;
    return true;
  }

  bool integer(const std::string& name, int64_t lo, int64_t hi, int64_t* out) {
    const json* v = get(name);
    if (v == nullptr) return true;
    if (!is_integer(*v)) return fail(name, "must be an integer, got " + type_name(*v));
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(hi)) {
      return fail(name, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                            "], got " + v->dump());
    }
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) {
      return fail(name, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                            "], got " + v->dump());
    }
    *out = x;
    return true;
  }

  bool boolean(const std::string& name, bool* out) {
    const json* v = get(name);
    if (v == nullptr) return true;
    if (!v->is_boolean()) return fail(name, "must be true or false, got " + type_name(*v));
    *out = v->get<bool>();
    return true;
  }

  bool fail(const std::string& field, const std::string& detail) {
    if (!error) error = bad(field, detail);
    return false;
  }

  // The first field of the body no reader asked for.
  std::optional<std::string> unknown() const {
    for (auto it = body_.begin(); it != body_.end(); ++it) {
      if (!seen_.contains(it.key())) return it.key();
    }
    return std::nullopt;
  }

  static bool is_integer(const json& v) {
    if (v.is_number_integer() || v.is_number_unsigned()) return true;
    // 2.0 is an integer to JavaScript clients.
    if (v.is_number_float()) {
      const double x = v.get<double>();
      return std::isfinite(x) && x == std::floor(x) && std::abs(x) < 9.0e15;
    }
    return false;
  }

  std::optional<ApiError> error;

 private:
  static std::string fmt(double x) {
    if (x == std::floor(x) && std::abs(x) < 1e15) return std::to_string(int64_t(x));
    json j = x;
    return j.dump();
  }
  const json& body_;
  std::set<std::string> seen_;
};

bool read_stop(Fields& f, api::SamplingParams& p) {
  const json* v = f.get("stop");
  if (v == nullptr) return true;
  if (v->is_string()) {
    if (!v->get<std::string>().empty()) p.stop.push_back(v->get<std::string>());
    return true;
  }
  if (!v->is_array()) return f.fail("stop", "must be a string or an array of strings");
  if (v->size() > 16)
    return f.fail("stop", "at most 16 stop strings, got " + std::to_string(v->size()));
  for (const json& s : *v) {
    if (!s.is_string()) return f.fail("stop", "must be a string or an array of strings");
    if (!s.get<std::string>().empty()) p.stop.push_back(s.get<std::string>());
  }
  return true;
}

bool read_token_ids(Fields& f, const std::string& name, std::vector<int32_t>* out) {
  const json* v = f.get(name);
  if (v == nullptr) return true;
  if (!v->is_array()) return f.fail(name, "must be an array of token ids");
  for (const json& id : *v) {
    if (!Fields::is_integer(id) || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return f.fail(name, "must be an array of token ids (integers >= 0)");
    }
    out->push_back(int32_t(id.get<int64_t>()));
  }
  return true;
}

bool read_logit_bias(Fields& f, api::SamplingParams& p) {
  const json* v = f.get("logit_bias");
  if (v == nullptr) return true;
  if (!v->is_object()) return f.fail("logit_bias", "must be an object of token id -> bias");
  for (auto it = v->begin(); it != v->end(); ++it) {
    const std::string& key = it.key();
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(key, &used);
    } catch (...) {
      used = 0;
    }
    if (used != key.size() || key.empty() || id < 0 || id > std::numeric_limits<int32_t>::max()) {
      return f.fail("logit_bias", "key \"" + key + "\" is not a token id");
    }
    if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < -100 ||
        it->get<double>() > 100) {
      return f.fail("logit_bias", "the bias of token " + key + " must be a number in [-100, 100]");
    }
    p.logit_bias[int32_t(id)] = it->get<double>();
  }
  return true;
}

// The sampling fields both endpoints share.
bool read_sampling(Fields& f, const ProtocolLimits& limits, api::SamplingParams& p) {
  const int64_t max_len = limits.max_model_len > 0 ? limits.max_model_len : (int64_t(1) << 31) - 1;
  double top_k = 0;
  int64_t seed = 0;
  bool ok = f.number("temperature", 0.0, 100.0, &p.temperature) &&
            f.number("top_p", 0.0, 1.0, &p.top_p) && f.number("min_p", 0.0, 1.0, &p.min_p) &&
            f.number("top_k", -1.0, double(std::numeric_limits<int32_t>::max()), &top_k) &&
            f.number("presence_penalty", -2.0, 2.0, &p.presence_penalty) &&
            f.number("frequency_penalty", -2.0, 2.0, &p.frequency_penalty) &&
            f.number("repetition_penalty", 0.0, 100.0, &p.repetition_penalty) &&
            f.integer("n", 1, 64, &p.n) && f.integer("min_tokens", 0, max_len, &p.min_tokens) &&
            f.integer("seed", std::numeric_limits<int64_t>::min(),
                      std::numeric_limits<int64_t>::max(), &seed) &&
            f.boolean("ignore_eos", &p.ignore_eos) &&
            f.boolean("include_stop_str_in_output", &p.include_stop_str_in_output) &&
            f.boolean("skip_special_tokens", &p.skip_special_tokens) && read_stop(f, p) &&
            read_token_ids(f, "stop_token_ids", &p.stop_token_ids) && read_logit_bias(f, p);
  if (!ok) return false;
  if (top_k != std::floor(top_k)) return f.fail("top_k", "must be an integer");
  if (p.repetition_penalty <= 0.0) return f.fail("repetition_penalty", "must be > 0");
  p.top_k = int64_t(top_k) == -1 ? 0 : int64_t(top_k);
  p.seed = uint64_t(seed);
  return true;
}

bool read_max_tokens(Fields& f, const ProtocolLimits& limits, const char* name,
                     ParsedRequest* out) {
  const int64_t max_len = limits.max_model_len > 0 ? limits.max_model_len : (int64_t(1) << 31) - 1;
  int64_t max_tokens = -1;
  if (!f.integer(name, 0, max_len, &max_tokens)) return false;
  if (max_tokens >= 0) {
    out->params.max_tokens = max_tokens;
    out->max_tokens_given = true;
  }
  return true;
}

bool read_stream(Fields& f, ParsedRequest* out) {
  if (!f.boolean("stream", &out->stream)) return false;
  const json* opts = f.get("stream_options");
  if (opts == nullptr) return true;
  if (!opts->is_object()) return f.fail("stream_options", "must be an object");
  for (auto it = opts->begin(); it != opts->end(); ++it) {
    if (it.key() == "include_usage") {
      if (!it->is_boolean()) return f.fail("stream_options.include_usage", "must be a boolean");
      out->include_usage = it->get<bool>();
    } else if (it.key() != "continuous_usage_stats") {
      return f.fail("stream_options." + it.key(), "not supported");
    }
  }
  if (!out->stream) return f.fail("stream_options", "only with stream: true");
  return true;
}

std::optional<ApiError> parse_completions(Fields& f, const ProtocolLimits& limits,
                                          ParsedRequest* out) {
  const json* prompt = f.get("prompt");
  if (prompt == nullptr) return bad("prompt", "required");
  if (prompt->is_string()) {
    out->prompt = api::Prompt(prompt->get<std::string>());
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
    std::vector<int32_t> ids;
    if (!read_token_ids(f, "prompt", &ids)) return f.error;
    out->prompt = api::Prompt(std::move(ids));
  } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
    out->prompt = api::Prompt((*prompt)[0].get<std::string>());
  } else if (prompt->is_array() && prompt->size() > 1) {
    return bad("prompt", "one prompt per request (a list of several is not supported)");
  } else {
    return bad("prompt", "must be a string, a list of one string, or a list of token ids");
  }
  out->params.max_tokens = 16;
  if (!read_max_tokens(f, limits, "max_tokens", out)) return f.error;
  int64_t logprobs = -1;
  if (!f.integer("logprobs", 0, limits.max_logprobs, &logprobs)) return f.error;
  if (logprobs >= 0) {
    out->logprobs = true;
    out->top_logprobs = logprobs;
    out->params.logprobs = logprobs;
  }
  if (!f.boolean("add_special_tokens", &out->add_special_tokens)) return f.error;
  bool echo = false;
  if (!f.boolean("echo", &echo)) return f.error;
  if (echo) return bad("echo", "not supported");
  if (const json* suffix = f.get("suffix"); suffix != nullptr) {
    return bad("suffix", "not supported");
  }
  if (!f.integer("best_of", 1, 64, &out->best_of)) return f.error;
  return std::nullopt;
}

std::optional<ApiError> parse_chat(Fields& f, const ProtocolLimits& limits, ParsedRequest* out) {
  const json* messages = f.get("messages");
  if (messages == nullptr) return bad("messages", "required");
  if (!messages->is_array() || messages->empty()) {
    return bad("messages", "must be a non-empty array of messages");
  }
  static const std::set<std::string> kRoles = {"system", "developer", "user", "assistant", "tool"};
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return bad(where, "must be an object");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) return bad(where + ".role", "required (a string)");
    if (!kRoles.contains(role->get<std::string>())) {
      return bad(where + ".role", "unknown role \"" + role->get<std::string>() +
                                      "\" (system, developer, user, assistant or tool)");
    }
    auto content = m.find("content");
    const bool has_calls =
        m.contains("tool_calls") && m["tool_calls"].is_array() && !m["tool_calls"].empty();
    if (content == m.end() || content->is_null()) {
      if (role->get<std::string>() != "assistant" || !has_calls) {
        return bad(where + ".content", "required");
      }
    } else if (content->is_array()) {
      for (const json& part : *content) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          return bad(where + ".content",
                     "only text parts ({\"type\": \"text\", \"text\": ...}) are supported");
        }
      }
    } else if (!content->is_string()) {
      return bad(where + ".content", "must be a string or an array of text parts");
    }
  }
  api::ChatJson chat;
  chat.messages = messages->dump();
  const json* tools = f.get("tools");
  if (tools != nullptr) {
    if (!tools->is_array()) return bad("tools", "must be an array of tools");
    for (const json& t : *tools) {
      if (!t.is_object() || t.value("type", "") != "function" || !t.contains("function") ||
          !t["function"].is_object() || !t["function"].contains("name") ||
          !t["function"]["name"].is_string()) {
        return bad("tools",
                   "each tool must be {\"type\": \"function\", \"function\": {\"name\", ...}}");
      }
    }
    if (!tools->empty()) chat.tools = tools->dump();
  }
  std::string tool_choice = "auto";
  if (const json* choice = f.get("tool_choice"); choice != nullptr) {
    if (choice->is_string() &&
        (choice->get<std::string>() == "none" || choice->get<std::string>() == "auto")) {
      tool_choice = choice->get<std::string>();
    } else {
      return bad("tool_choice", "only \"auto\" and \"none\" are supported");
    }
  }
  out->parse_tool_calls = !chat.tools.empty() && tool_choice != "none";
  if (const json* kwargs = f.get("chat_template_kwargs"); kwargs != nullptr) {
    if (!kwargs->is_object()) return bad("chat_template_kwargs", "must be an object");
    chat.template_kwargs = kwargs->dump();
  }
  bool add_generation_prompt = true;
  if (const json* agp = f.get("add_generation_prompt"); agp != nullptr) {
    if (!f.boolean("add_generation_prompt", &add_generation_prompt)) return f.error;
    chat.add_generation_prompt = add_generation_prompt;
  }
  bool continue_final = false;
  if (!f.boolean("continue_final_message", &continue_final)) return f.error;
  if (continue_final) return bad("continue_final_message", "not supported");
  if (const json* format = f.get("response_format"); format != nullptr) {
    if (!format->is_object() || format->value("type", "") != "text") {
      return bad("response_format", "only {\"type\": \"text\"} is supported");
    }
  }
  out->prompt = api::Prompt(std::move(chat));
  if (!read_max_tokens(f, limits, "max_tokens", out)) return f.error;
  if (!read_max_tokens(f, limits, "max_completion_tokens", out)) return f.error;
  if (!f.boolean("logprobs", &out->logprobs)) return f.error;
  if (!f.integer("top_logprobs", 0, limits.max_logprobs, &out->top_logprobs)) return f.error;
  if (out->top_logprobs > 0 && !out->logprobs) {
    return bad("top_logprobs", "needs logprobs: true");
  }
  if (out->logprobs) out->params.logprobs = out->top_logprobs;
  return std::nullopt;
}

std::string random_chars(size_t n, std::string_view alphabet) {
  thread_local std::mt19937_64 gen{std::random_device{}()};
  std::uniform_int_distribution<size_t> pick(0, alphabet.size() - 1);
  std::string s;
  for (size_t i = 0; i < n; ++i) s.push_back(alphabet[pick(gen)]);
  return s;
}

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

}  // namespace

json error_body(const ApiError& error) {
  return {{"error",
           {{"message", error.message},
            {"type", error_type(error.status)},
            {"param", error.param.empty() ? json(nullptr) : json(error.param)},
            {"code", error.status}}}};
}

std::optional<ApiError> parse_request(Endpoint endpoint, const json& body,
                                      const ProtocolLimits& limits, ParsedRequest* out) {
  if (!body.is_object()) return ApiError{400, "the request body must be a JSON object", ""};
  Fields f(body);
  out->endpoint = endpoint;
  if (const json* model = f.get("model"); model != nullptr) {
    if (!model->is_string()) return bad("model", "must be a string");
    out->model = model->get<std::string>();
  }
  for (const char* ignored : kIgnoredFields) f.get(ignored);
  std::optional<ApiError> err = endpoint == Endpoint::kCompletions
                                    ? parse_completions(f, limits, out)
                                    : parse_chat(f, limits, out);
  if (err) return err;
  out->seed_given = body.contains("seed") && !body["seed"].is_null();
  if (!read_sampling(f, limits, out->params) || !read_stream(f, out)) return f.error;
  if (out->best_of != 0 && out->best_of != out->params.n) {
    return bad("best_of", "not supported (only best_of equal to n)");
  }
  if (std::optional<std::string> unknown = f.unknown()) {
    return bad(*unknown, "unknown or unsupported field");
  }
  return std::nullopt;
}

ChoiceBuilder::ChoiceBuilder(Endpoint endpoint, int32_t index, const OutputParsing& parsing,
                             bool logprobs)
    : endpoint_(endpoint), index_(index), parsing_(parsing), want_logprobs_(logprobs) {
  if (endpoint_ == Endpoint::kChat && parsing_.reasoning) {
    reasoning_.emplace(parsing_.reasoning_opened);
  }
  if (endpoint_ == Endpoint::kChat && parsing_.tool_calls) {
    tools_.emplace(parsing_.make_tool_call_id);
  }
}

ChoiceBuilder::Delta ChoiceBuilder::take_text(const std::string& text, bool final) {
  Delta d;
  std::string content = text;
  if (reasoning_) {
    ReasoningText r = reasoning_->feed(text);
    if (final) {
      ReasoningText rest = reasoning_->finish();
      r.reasoning += rest.reasoning;
      r.content += rest.content;
    }
    d.reasoning = std::move(r.reasoning);
    content = std::move(r.content);
  }
  if (tools_) {
    ToolCallStreamDelta t = tools_->feed(content);
    if (final) {
      ToolCallStreamDelta rest = tools_->finish();
      t.content += rest.content;
      t.tool_calls.insert(t.tool_calls.end(), rest.tool_calls.begin(), rest.tool_calls.end());
    }
    d.content = std::move(t.content);
    d.tool_calls = std::move(t.tool_calls);
  } else {
    d.content = std::move(content);
  }
  content_ += d.content;
  reasoning_text_ += d.reasoning;
  for (const ToolCallDelta& c : d.tool_calls) {
    if (c.first) {
      calls_.push_back(ToolCall{c.id, c.name, c.arguments});
    } else if (c.index >= 0 && size_t(c.index) < calls_.size()) {
      calls_[size_t(c.index)].arguments += c.arguments;
    }
  }
  return d;
}

json ChoiceBuilder::logprobs_json(const std::vector<api::Logprob>& entries) {
  if (endpoint_ == Endpoint::kChat) {
    json content = json::array();
    for (const api::Logprob& e : entries) {
      json top = json::array();
      for (const api::TopLogprob& t : e.top_logprobs) {
        top.push_back({{"token", t.token}, {"logprob", t.logprob}, {"bytes", bytes_of(t.token)}});
      }
      content.push_back({{"token", e.token},
                         {"logprob", e.logprob},
                         {"bytes", bytes_of(e.token)},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  for (const api::Logprob& e : entries) {
    tokens.push_back(e.token);
    token_logprobs.push_back(e.logprob);
    json t = json::object();
    for (const api::TopLogprob& x : e.top_logprobs) t[x.token] = x.logprob;
    top.push_back(std::move(t));
    offsets.push_back(text_offset_);
    text_offset_ += int64_t(e.token.size());
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top)},
          {"text_offset", std::move(offsets)}};
}

void ChoiceBuilder::finish(const api::CompletionOutput& out) {
  finished_ = true;
  finish_reason_ = out.finish_reason;
  error_ = out.error;
  if (!out.stop_string.empty()) {
    stop_reason_ = out.stop_string;
  } else if (out.stop_token_id >= 0) {
    stop_reason_ = out.stop_token_id;
  }
  if (finish_reason_ == "stop" && !calls_.empty()) finish_reason_ = "tool_calls";
}

std::vector<json> ChoiceBuilder::stream_choices(const api::CompletionOutput& out) {
  std::vector<json> choices;
  if (finished_) return choices;
  const Delta d = take_text(out.text, out.finished);
  if (out.finished) finish(out);
  json logprobs = nullptr;
  if (want_logprobs_ && !out.logprobs.empty()) logprobs = logprobs_json(out.logprobs);
  if (endpoint_ == Endpoint::kCompletions) {
    if (d.content.empty() && logprobs.is_null() && !out.finished) return choices;
    json c = {{"index", index_},
              {"text", d.content},
              {"logprobs", logprobs},
              {"finish_reason", out.finished ? json(finish_reason_) : json(nullptr)}};
    if (out.finished) c["stop_reason"] = stop_reason_;
    choices.push_back(std::move(c));
    return choices;
  }
  json delta = json::object();
  if (!sent_role_) {
    sent_role_ = true;
    delta["role"] = "assistant";
    delta["content"] = "";
  }
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.content.empty()) delta["content"] = d.content;
  if (!d.tool_calls.empty()) {
    json calls = json::array();
    for (const ToolCallDelta& c : d.tool_calls) calls.push_back(tool_call_delta_json(c));
    delta["tool_calls"] = std::move(calls);
  }
  const bool has_delta = !delta.empty();
  if (!has_delta && logprobs.is_null() && !out.finished) return choices;
  json c = {{"index", index_},
            {"delta", std::move(delta)},
            {"logprobs", logprobs},
            {"finish_reason", out.finished ? json(finish_reason_) : json(nullptr)}};
  if (out.finished) c["stop_reason"] = stop_reason_;
  choices.push_back(std::move(c));
  return choices;
}

void ChoiceBuilder::add(const api::CompletionOutput& out) {
  if (finished_) return;
  text_ += out.text;
  take_text(out.text, out.finished);
  logprobs_.insert(logprobs_.end(), out.logprobs.begin(), out.logprobs.end());
  if (out.finished) finish(out);
}

json ChoiceBuilder::whole_choice() const {
  ChoiceBuilder copy = *this;  // logprobs_json advances the text offset
  json logprobs = want_logprobs_ ? copy.logprobs_json(logprobs_) : json(nullptr);
  if (endpoint_ == Endpoint::kCompletions) {
    return {{"index", index_},
            {"text", content_},
            {"logprobs", logprobs},
            {"finish_reason", finish_reason_},
            {"stop_reason", stop_reason_}};
  }
  json message = {
      {"role", "assistant"},
      {"content", content_.empty() && !calls_.empty() ? json(nullptr) : json(content_)}};
  if (reasoning_)
    message["reasoning_content"] = reasoning_text_.empty() ? json(nullptr) : json(reasoning_text_);
  if (!calls_.empty()) {
    json calls = json::array();
    for (const ToolCall& c : calls_) calls.push_back(tool_call_json(c));
    message["tool_calls"] = std::move(calls);
  }
  return {{"index", index_},
          {"message", std::move(message)},
          {"logprobs", logprobs},
          {"finish_reason", finish_reason_},
          {"stop_reason", stop_reason_}};
}

std::string to_text(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

json usage_json(const api::Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.total_tokens}};
}

std::string make_response_id(const char* prefix) {
  return std::string(prefix) + random_chars(24, "0123456789abcdef");
}

}  // namespace e4kv::serve
