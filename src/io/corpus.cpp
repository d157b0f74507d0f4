#include "io/corpus.h"

#include <charconv>
#include <optional>

#include "core/file_io.h"
#include "core/json.h"

namespace e4kv {
namespace {

using json = nlohmann::ordered_json;

Status line_error(const std::string& source, int64_t line, const std::string& what) {
  return Status::error(cat(source, ":", line, ": ", what));
}

// What is wrong with the tool call at `path` (OpenAI's form: {"type": "function", "function":
// {"name": string, "arguments": string or object}, "id": string (optional)}), nullopt if nothing.
std::optional<std::string> tool_call_error(const json& call, const std::string& path) {
  if (!call.is_object()) return cat(path, ": expected a tool call object, got ", call.type_name());
  const auto type = call.find("type");
  if (type == call.end() || !type->is_string() || type->get<std::string>() != "function") {
    return cat(path, ".type: expected \"function\", got ",
               type == call.end() ? "nothing" : type->dump());
  }
  if (const auto id = call.find("id"); id != call.end() && !id->is_string()) {
    return cat(path, ".id: expected a string, got ", id->type_name());
  }
  const auto function = call.find("function");
  if (function == call.end() || !function->is_object()) {
    return cat(path, ".function: expected an object {\"name\": ..., \"arguments\": ...}, got ",
               function == call.end() ? "nothing" : function->type_name());
  }
  const auto name = function->find("name");
  if (name == function->end() || !name->is_string()) {
    return cat(path, ".function.name: expected a string, got ",
               name == function->end() ? "nothing" : name->type_name());
  }
  const auto arguments = function->find("arguments");
  if (arguments == function->end() || !(arguments->is_string() || arguments->is_object())) {
    return cat(path, ".function.arguments: expected a string or an object, got ",
               arguments == function->end() ? "nothing" : arguments->type_name());
  }
  return std::nullopt;
}

// What is wrong with the message at `path`, nullopt if nothing. A chat template trusts its
// messages' shape (a role it does not know can fall through its branches, a content that is not
// a string prints as Python's repr), so a document gets only what the templates are written for:
// a known role, string content (null or absent only beside tool calls), tool calls of OpenAI's
// form on an assistant message, and string names and ids. Other keys are passed through.
std::optional<std::string> message_error(const json& message, const std::string& path) {
  if (!message.is_object()) {
    return cat(path, ": expected a message object {\"role\": ..., \"content\": ...}, got ",
               message.type_name());
  }
  const auto role_it = message.find("role");
  if (role_it == message.end() || !role_it->is_string()) {
    return cat(path, ".role: expected a string (system, user, assistant or tool), got ",
               role_it == message.end() ? "nothing" : role_it->type_name());
  }
  const std::string role = role_it->get<std::string>();
  if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
    return cat(path, ".role: unknown role ", role_it->dump(),
               " (expected system, user, assistant or tool)");
  }
  const auto tool_calls = message.find("tool_calls");
  const bool has_tool_calls = tool_calls != message.end() && !tool_calls->is_null();
  if (has_tool_calls) {
    if (role != "assistant") {
      return cat(path, ".tool_calls: only an assistant message makes tool calls, not a ", role,
                 " message");
    }
    if (!tool_calls->is_array()) {
      return cat(path, ".tool_calls: expected an array of tool calls, got ",
                 tool_calls->type_name());
    }
    for (size_t i = 0; i < tool_calls->size(); ++i) {
      if (std::optional<std::string> error =
              tool_call_error((*tool_calls)[i], cat(path, ".tool_calls[", i, "]"))) {
        return error;
      }
    }
  }
  const auto content = message.find("content");
  const bool may_be_empty = role == "assistant" && has_tool_calls;
  if (content == message.end() || content->is_null()) {
    if (!may_be_empty) {
      return cat(path, ".content: expected a string, got ",
                 content == message.end() ? "nothing" : "null",
                 " (only an assistant message with tool_calls may leave it out)");
    }
  } else if (!content->is_string()) {
    return cat(path, ".content: expected a string, got ", content->type_name());
  }
  for (const char* key : {"name", "tool_call_id", "reasoning_content"}) {
    const auto it = message.find(key);
    if (it != message.end() && !it->is_null() && !it->is_string()) {
      return cat(path, ".", key, ": expected a string, got ", it->type_name());
    }
  }
  return std::nullopt;
}

Result<CorpusDocument> parse_document(const json& value, const std::string& source, int64_t line) {
  if (!value.is_object()) {
    return line_error(source, line,
                      "expected a JSON object with one of \"text\", \"token_ids\" or \"messages\"");
  }
  int keys = 0;
  for (const char* key : {"text", "token_ids", "messages"}) keys += value.contains(key) ? 1 : 0;
  if (keys != 1) {
    return line_error(source, line,
                      cat(keys == 0 ? "none" : "more than one", " of \"text\", \"token_ids\" and "
                          "\"messages\"; give exactly one per line"));
  }
  CorpusDocument doc;
  doc.line = line;
  if (const auto it = value.find("text"); it != value.end()) {
    if (!it->is_string()) return line_error(source, line, "\"text\" must be a string");
    doc.kind = CorpusKind::kText;
    doc.text = it->get<std::string>();
    if (doc.text.empty()) return line_error(source, line, "\"text\" is empty");
  } else if (const auto ids = value.find("token_ids"); ids != value.end()) {
    if (!ids->is_array() || ids->empty()) {
      return line_error(source, line, "\"token_ids\" must be a non-empty array of integers");
    }
    doc.kind = CorpusKind::kTokenIds;
    for (size_t i = 0; i < ids->size(); ++i) {
      const json& id = (*ids)[i];
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        return line_error(source, line,
                          cat("\"token_ids\"[", i, "] is ", json_excerpt(id),
                              "; expected an integer token id >= 0"));
      }
      doc.token_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
  } else {
    const json& messages = value["messages"];
    if (!messages.is_array() || messages.empty()) {
      return line_error(source, line, "\"messages\" must be a non-empty array of messages");
    }
    for (size_t i = 0; i < messages.size(); ++i) {
      if (const std::optional<std::string> error =
              message_error(messages[i], cat("messages[", i, "]"))) {
        return line_error(source, line, *error);
      }
    }
    doc.kind = CorpusKind::kMessages;
    doc.messages = messages;
  }
  for (const auto& [key, field] : value.items()) {
    if (key != "text" && key != "token_ids" && key != "messages") doc.fields[key] = field;
  }
  return doc;
}

}  // namespace

Result<std::vector<CorpusDocument>> parse_corpus(std::string_view text, const std::string& source) {
  std::vector<CorpusDocument> documents;
  int64_t line = 0;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    std::string_view row = text.substr(begin, end - begin);
    begin = end + 1;
    ++line;
    if (!row.empty() && row.back() == '\r') row.remove_suffix(1);
    if (row.find_first_not_of(" \t") == std::string_view::npos) continue;
    E4KV_ASSIGN_OR_RETURN(const json value, parse_ordered_json(row, cat(source, ":", line)));
    E4KV_ASSIGN_OR_RETURN(CorpusDocument doc, parse_document(value, source, line));
    documents.push_back(std::move(doc));
  }
  if (documents.empty()) {
    return Status::error(cat(source, ": no documents (one JSON object per line: {\"text\": ...}, "
                                     "{\"token_ids\": [...]} or {\"messages\": [...]})"));
  }
  return documents;
}

Result<std::vector<CorpusDocument>> read_corpus(const std::filesystem::path& path) {
  E4KV_ASSIGN_OR_RETURN(const std::string text, read_file(path));
  return parse_corpus(text, path.string());
}

Result<CorpusShard> parse_corpus_shard(std::string_view text) {
  const size_t slash = text.find('/');
  CorpusShard shard;
  auto number = [](std::string_view s, int64_t& out) {
    const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc() && ptr == s.data() + s.size() && !s.empty();
  };
  if (slash == std::string_view::npos || !number(text.substr(0, slash), shard.index) ||
      !number(text.substr(slash + 1), shard.count) || shard.count < 1 || shard.index < 0 ||
      shard.index >= shard.count) {
    return Status::error(cat("--shard ", text,
                             ": expected I/N with 0 <= I < N (this process's shard of N), e.g. "
                             "0/4"));
  }
  return shard;
}

std::vector<CorpusDocument> select_shard(std::vector<CorpusDocument> documents,
                                         const CorpusShard& shard) {
  std::vector<CorpusDocument> out;
  for (size_t d = 0; d < documents.size(); ++d) {
    if (int64_t(d) % shard.count == shard.index) out.push_back(std::move(documents[d]));
  }
  return out;
}

}  // namespace e4kv
