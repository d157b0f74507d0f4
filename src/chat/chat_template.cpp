#include "chat/chat_template.h"

#include "core/file_io.h"
#include "core/json.h"

namespace e4kv {
namespace {

using ordered_json = nlohmann::ordered_json;

constexpr std::string_view kNoTemplateAdvice =
    "pass the prompt as token ids or as plain text instead of chat messages, or add a "
    "chat_template.jinja to the checkpoint";

// The JSON object in `path`, nullopt when the file does not exist.
Result<std::optional<ordered_json>> read_json_object(const std::filesystem::path& path) {
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> text, read_optional_file(path));
  if (!text) return std::optional<ordered_json>();
  E4KV_ASSIGN_OR_RETURN(ordered_json root, parse_ordered_json(*text, path.string()));
  if (!root.is_object()) return Status::error(cat(path.string(), ": not a JSON object"));
  return std::optional<ordered_json>(std::move(root));
}

// A special token as tokenizer_config.json writes it: "<s>", {"content": "<s>", ...} or null.
Result<std::optional<std::string>> special_token(const ordered_json& config,
                                                 const std::filesystem::path& path,
                                                 std::string_view key) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return std::optional<std::string>((*it)["content"].get<std::string>());
  }
  return Status::error(cat(path.string(), ": \"", key,
                           "\" must be a string or an object with a string \"content\", got ",
                           json_excerpt(*it)));
}

// The template in a "chat_template" value: a string, or a list of {"name", "template"}.
Result<std::optional<std::string>> pick_template(const ordered_json& value,
                                                 const std::filesystem::path& path,
                                                 std::string_view name) {
  const std::string wanted = name.empty() ? "default" : std::string(name);
  if (value.is_string()) {
    if (wanted != "default") {
      return Status::error(
          cat(path.string(), ": has a single chat template, no template named \"", wanted, "\""));
    }
    return std::optional<std::string>(value.get<std::string>());
  }
  if (!value.is_array()) {
    return Status::error(cat(path.string(),
                             ": \"chat_template\" must be a string or a list of {\"name\", "
                             "\"template\"} objects, got ",
                             value.type_name()));
  }
  std::string names;
  for (const ordered_json& entry : value) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        !entry.contains("template") || !entry["template"].is_string()) {
      return Status::error(cat(path.string(),
                               ": each \"chat_template\" entry must be "
                               "{\"name\": string, \"template\": string}"));
    }
    const std::string entry_name = entry["name"].get<std::string>();
    if (entry_name == wanted)
      return std::optional<std::string>(entry["template"].get<std::string>());
    names += cat(names.empty() ? "" : ", ", "\"", entry_name, "\"");
  }
  return Status::error(cat(path.string(), ": no chat template named \"", wanted,
                           "\" (the checkpoint has ", names.empty() ? "none" : names, ")"));
}

}  // namespace

namespace {

// bos_token / eos_token of the checkpoint in `dir` (tokenizer_config.json), when it sets them.
struct SpecialTokens {
  std::optional<std::string> bos, eos;
};
Result<SpecialTokens> special_tokens(const std::filesystem::path& dir,
                                     std::optional<ordered_json>* config_out = nullptr) {
  const std::filesystem::path config_path = dir / "tokenizer_config.json";
  E4KV_ASSIGN_OR_RETURN(std::optional<ordered_json> config, read_json_object(config_path));
  SpecialTokens tokens;
  if (config) {
    E4KV_ASSIGN_OR_RETURN(tokens.bos, special_token(*config, config_path, "bos_token"));
    E4KV_ASSIGN_OR_RETURN(tokens.eos, special_token(*config, config_path, "eos_token"));
  }
  if (config_out != nullptr) *config_out = std::move(config);
  return tokens;
}

}  // namespace

Result<ChatTemplate> ChatTemplate::load(const std::filesystem::path& dir, std::string_view name) {
  const std::filesystem::path config_path = dir / "tokenizer_config.json";
  std::optional<ordered_json> config;
  E4KV_ASSIGN_OR_RETURN(SpecialTokens tokens, special_tokens(dir, &config));
  std::optional<std::string> bos_token = std::move(tokens.bos);
  std::optional<std::string> eos_token = std::move(tokens.eos);

  const bool named = !name.empty() && name != "default";
  std::optional<std::string> source;
  std::filesystem::path origin;
  // 1. A template file.
  origin =
      named ? dir / "additional_chat_templates" / cat(name, ".jinja") : dir / "chat_template.jinja";
  E4KV_ASSIGN_OR_RETURN(source, read_optional_file(origin));
  // 2. tokenizer_config.json.
  if (!source && config && config->contains("chat_template") &&
      !(*config)["chat_template"].is_null()) {
    origin = config_path;
    E4KV_ASSIGN_OR_RETURN(source, pick_template((*config)["chat_template"], config_path, name));
  }
  // 3. chat_template.json.
  if (!source) {
    const std::filesystem::path processor_path = dir / "chat_template.json";
    E4KV_ASSIGN_OR_RETURN(std::optional<ordered_json> processor, read_json_object(processor_path));
    if (processor && processor->contains("chat_template") &&
        !(*processor)["chat_template"].is_null()) {
      origin = processor_path;
      E4KV_ASSIGN_OR_RETURN(source,
                            pick_template((*processor)["chat_template"], processor_path, name));
    }
  }
  if (!source) {
    if (named) {
      return Status::error(cat(dir.string(), ": the checkpoint has no chat template named \"", name,
                               "\" (no additional_chat_templates/", name,
                               ".jinja and none in tokenizer_config.json)"));
    }
    return Status::error(cat(dir.string(),
                             ": the checkpoint has no chat template (no chat_template.jinja and no "
                             "\"chat_template\" in tokenizer_config.json or chat_template.json); ",
                             kNoTemplateAdvice));
  }
  Result<ChatTemplate> loaded =
      from_source(std::move(*source), std::move(bos_token), std::move(eos_token));
  if (!loaded.ok()) return Status::error(cat(origin.string(), ": ", loaded.message()));
  return loaded;
}

Result<ChatTemplate> ChatTemplate::load_file(const std::filesystem::path& file,
                                             const std::filesystem::path& dir) {
  E4KV_ASSIGN_OR_RETURN(SpecialTokens tokens, special_tokens(dir));
  E4KV_ASSIGN_OR_RETURN(std::optional<std::string> source, read_optional_file(file));
  if (!source) {
    return Status::error(cat(file.string(), ": no such chat template file; give a .jinja file"));
  }
  Result<ChatTemplate> loaded =
      from_source(std::move(*source), std::move(tokens.bos), std::move(tokens.eos));
  if (!loaded.ok()) return Status::error(cat(file.string(), ": ", loaded.message()));
  return loaded;
}

Result<ChatTemplate> ChatTemplate::from_source(std::string source,
                                               std::optional<std::string> bos_token,
                                               std::optional<std::string> eos_token) {
  E4KV_ASSIGN_OR_RETURN(JinjaTemplate engine, JinjaTemplate::parse(source, "chat template"));
  return ChatTemplate(std::move(engine), std::move(source), std::move(bos_token),
                      std::move(eos_token));
}

Result<std::string> ChatTemplate::render(const ordered_json& messages,
                                         const ChatRenderOptions& options) const {
  E4KV_ASSIGN_OR_RETURN(RenderedPrompt prompt, render_tracked(messages, options));
  return std::move(prompt.text);
}

Result<RenderedPrompt> ChatTemplate::render_tracked(const ordered_json& messages,
                                                    const ChatRenderOptions& options) const {
  if (!messages.is_array()) {
    return Status::option_error(
        "messages", cat("must be a JSON array of message objects, got ", messages.type_name()));
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object()) {
      return Status::option_error(
          "messages", cat("message ", i, " must be a JSON object, got ", messages[i].type_name()));
    }
  }
  if (options.tools && !options.tools->is_array()) {
    return Status::option_error(
        "tools", cat("must be a JSON array of tool schemas, got ", options.tools->type_name()));
  }
  if (!options.extra.is_object()) {
    return Status::option_error("extra", cat("must be a JSON object of template variables, got ",
                                             options.extra.type_name()));
  }
  // The checkpoint's tokens are trusted; everything the caller passes is not.
  ordered_json trusted = ordered_json::object();
  trusted["documents"] = nullptr;
  trusted["add_generation_prompt"] = options.add_generation_prompt;
  if (bos_token_) trusted["bos_token"] = *bos_token_;
  if (eos_token_) trusted["eos_token"] = *eos_token_;
  ordered_json untrusted = ordered_json::object();
  untrusted["messages"] = messages;
  untrusted["tools"] = options.tools ? *options.tools : ordered_json(nullptr);
  for (const auto& [key, value] : options.extra.items()) {
    if (key == "messages" || key == "tools" || key == "documents" ||
        key == "add_generation_prompt") {
      return Status::option_error("extra", cat("\"", key,
                                               "\" is set by its own option, not as an "
                                               "extra template variable"));
    }
    // An extra variable replaces a token of the checkpoint of the same name, as it does in
    // transformers; then it is the caller's.
    trusted.erase(key);
    untrusted[key] = value;
  }
  E4KV_ASSIGN_OR_RETURN(RenderedPrompt prompt,
                        engine_.render_tracked(trusted, untrusted, options.limits));
  if (options.special_tokens_in_content) prompt.untrusted.clear();
  return prompt;
}

}  // namespace e4kv
