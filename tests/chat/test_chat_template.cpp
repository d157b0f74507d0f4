// ChatTemplate: loading from a checkpoint directory, and the golden renders of real chat templates
// (tests/data/chat_templates/*/: template.jinja, SOURCE.md, expected.json written by the reference
// @huggingface/jinja through scripts/chat_template_goldens.mjs). Every case must render byte for
// byte as the reference did; where the reference raised, e4kv must fail too, and with the
// template's own message when the template called raise_exception.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "core/sha256.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;
using testing_support::read_text;
using testing_support::TempDir;
using testing_support::write_text;

const fs::path kDataDir = fs::path(E4KV_SOURCE_DIR) / "tests" / "data" / "chat_templates";

std::string quoted(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string text_mismatch(const std::string& got, const std::string& want) {
  size_t first = 0;
  while (first < got.size() && first < want.size() && got[first] == want[first]) ++first;
  const size_t from = first >= 40 ? first - 40 : 0;
  return cat("first difference at byte ", first, " (expected ", want.size(), " bytes, got ",
             got.size(), ")\n  expected: ", quoted(want.substr(from, 100)),
             "\n  e4kv:     ", quoted(got.substr(from, 100)));
}

std::vector<std::string> template_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(kDataDir, ec)) {
    if (entry.is_directory() && fs::exists(entry.path() / "template.jinja")) {
      names.push_back(entry.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Each template is stored verbatim: its SHA-256 is the published one SOURCE.md records.
TEST(ChatTemplateGolden, EveryTemplateHasGoldensAndAVerifiedSource) {
  const std::vector<std::string> names = template_names();
  ASSERT_GE(names.size(), 5u) << "chat templates missing under " << kDataDir;
  for (const std::string& name : names) {
    EXPECT_TRUE(fs::exists(kDataDir / name / "expected.json"))
        << name << ": run `node scripts/chat_template_goldens.mjs <dir with @huggingface/jinja>`";
    const std::string source_md = read_text(kDataDir / name / "SOURCE.md");
    const size_t at = source_md.find("SHA-256 `");
    ASSERT_NE(at, std::string::npos) << name << ": SOURCE.md records no SHA-256";
    EXPECT_EQ(sha256_hex(read_text(kDataDir / name / "template.jinja")),
              source_md.substr(at + 9, 64))
        << name << ": template.jinja is not the published file SOURCE.md names";
  }
}

TEST(ChatTemplateGolden, MatchesTheReferenceRenderer) {
  const ordered_json conversations =
      ordered_json::parse(read_text(kDataDir / "conversations.json"));
  const ordered_json shared_context = conversations.value("context", ordered_json::object());
  size_t checked = 0;
  for (const std::string& name : template_names()) {
    const ordered_json golden = ordered_json::parse(read_text(kDataDir / name / "expected.json"));
    auto optional_token = [&](const char* key) -> std::optional<std::string> {
      if (golden[key].is_null()) return std::nullopt;
      return golden[key].get<std::string>();
    };
    Result<ChatTemplate> chat =
        ChatTemplate::from_source(read_text(kDataDir / name / "template.jinja"),
                                  optional_token("bos_token"), optional_token("eos_token"));
    ASSERT_TRUE(chat.ok()) << name << ": " << chat.message();
    for (const ordered_json& expected : golden["cases"]) {
      const std::string conversation_name = expected["conversation"].get<std::string>();
      const auto conversation =
          std::find_if(conversations["conversations"].begin(), conversations["conversations"].end(),
                       [&](const ordered_json& c) { return c["name"] == conversation_name; });
      ASSERT_NE(conversation, conversations["conversations"].end()) << conversation_name;
      ChatRenderOptions options;
      options.add_generation_prompt = expected["add_generation_prompt"].get<bool>();
      if (conversation->contains("tools")) options.tools = (*conversation)["tools"];
      options.extra = shared_context;
      const ordered_json extra = expected.value("extra", ordered_json::object());
      for (const auto& [key, value] : extra.items()) options.extra[key] = value;
      const std::string label = cat(name, " / ", conversation_name,
                                    " / add_generation_prompt=", options.add_generation_prompt,
                                    " / extra=", extra.dump());
      const Result<std::string> rendered = chat->render((*conversation)["messages"], options);
      ++checked;
      if (expected.contains("expected")) {
        ASSERT_TRUE(rendered.ok()) << label << ": " << rendered.message();
        const std::string want = expected["expected"].get<std::string>();
        EXPECT_EQ(*rendered, want) << label << ": " << text_mismatch(*rendered, want);
      } else {
        const std::string error = expected["error"].get<std::string>();
        ASSERT_FALSE(rendered.ok()) << label << ": the reference failed (" << error
                                    << ") but e4kv rendered " << quoted(rendered.value());
        if (expected["raised"].get<bool>()) {
          EXPECT_NE(rendered.message().find(error), std::string::npos)
              << label
              << ": e4kv's error does not carry the template's message\n  reference: " << error
              << "\n  e4kv:      " << rendered.message();
        }
      }
    }
  }
  EXPECT_GE(checked, 100u);
}

// ---- Loading from a checkpoint directory --------------------------------------------------------

TEST(ChatTemplateLoad, PrefersChatTemplateJinjaAndReadsSpecialTokens) {
  TempDir dir;
  write_text(dir.path() / "chat_template.jinja", "{{ bos_token }}[{{ messages[0].content }}]");
  write_text(dir.path() / "tokenizer_config.json",
             R"({"chat_template": "from config", "bos_token": {"content": "<s>", "lstrip": false},
                 "eos_token": "</s>"})");
  Result<ChatTemplate> chat = ChatTemplate::load(dir.path());
  ASSERT_TRUE(chat.ok()) << chat.message();
  EXPECT_EQ(chat->bos_token(), std::optional<std::string>("<s>"));
  EXPECT_EQ(chat->eos_token(), std::optional<std::string>("</s>"));
  const Result<std::string> out =
      chat->render(ordered_json::parse(R"([{"role": "user", "content": "hi"}])"));
  ASSERT_TRUE(out.ok()) << out.message();
  EXPECT_EQ(*out, "<s>[hi]");
}

TEST(ChatTemplateLoad, ReadsTheStringInTokenizerConfig) {
  TempDir dir;
  write_text(
      dir.path() / "tokenizer_config.json",
      R"({"chat_template": "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{{ eos_token }}",
                 "bos_token": null, "eos_token": "<|im_end|>"})");
  Result<ChatTemplate> chat = ChatTemplate::load(dir.path());
  ASSERT_TRUE(chat.ok()) << chat.message();
  EXPECT_FALSE(chat->bos_token().has_value());
  const Result<std::string> out = chat->render(ordered_json::parse(
      R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])"));
  ASSERT_TRUE(out.ok()) << out.message();
  EXPECT_EQ(*out, "user:a;assistant:b;<|im_end|>");
}

TEST(ChatTemplateLoad, PicksANamedTemplateFromAList) {
  TempDir dir;
  write_text(dir.path() / "tokenizer_config.json",
             R"({"chat_template": [{"name": "default", "template": "plain"},
                                   {"name": "tool_use", "template": "tools={{ tools | length }}"}]})");
  Result<ChatTemplate> plain = ChatTemplate::load(dir.path());
  ASSERT_TRUE(plain.ok()) << plain.message();
  EXPECT_EQ(plain->source(), "plain");
  Result<ChatTemplate> tool_use = ChatTemplate::load(dir.path(), "tool_use");
  ASSERT_TRUE(tool_use.ok()) << tool_use.message();
  ChatRenderOptions options;
  options.tools = ordered_json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  const Result<std::string> out = tool_use->render(ordered_json::array(), options);
  ASSERT_TRUE(out.ok()) << out.message();
  EXPECT_EQ(*out, "tools=1");

  Result<ChatTemplate> missing = ChatTemplate::load(dir.path(), "rag");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("no chat template named \"rag\""), std::string::npos)
      << missing.message();
  EXPECT_NE(missing.message().find("\"default\", \"tool_use\""), std::string::npos)
      << missing.message();
}

TEST(ChatTemplateLoad, ReadsAdditionalTemplateFilesByName) {
  TempDir dir;
  write_text(dir.path() / "chat_template.jinja", "default");
  fs::create_directories(dir.path() / "additional_chat_templates");
  write_text(dir.path() / "additional_chat_templates" / "tool_use.jinja", "tool use");
  Result<ChatTemplate> chat = ChatTemplate::load(dir.path(), "tool_use");
  ASSERT_TRUE(chat.ok()) << chat.message();
  EXPECT_EQ(chat->source(), "tool use");
}

TEST(ChatTemplateLoad, AMissingTemplateSaysWhatToDo) {
  TempDir dir;
  write_text(dir.path() / "tokenizer_config.json", R"({"eos_token": "</s>"})");
  Result<ChatTemplate> chat = ChatTemplate::load(dir.path());
  ASSERT_FALSE(chat.ok());
  EXPECT_NE(chat.message().find("has no chat template"), std::string::npos) << chat.message();
  EXPECT_NE(chat.message().find("token ids"), std::string::npos) << chat.message();

  TempDir empty;
  Result<ChatTemplate> nothing = ChatTemplate::load(empty.path());
  ASSERT_FALSE(nothing.ok());
  EXPECT_NE(nothing.message().find("has no chat template"), std::string::npos) << nothing.message();
}

TEST(ChatTemplateLoad, RefusesMalformedConfigs) {
  TempDir dir;
  write_text(dir.path() / "tokenizer_config.json", "{not json");
  Result<ChatTemplate> bad_json = ChatTemplate::load(dir.path());
  ASSERT_FALSE(bad_json.ok());
  EXPECT_NE(bad_json.message().find("tokenizer_config.json: invalid JSON"), std::string::npos)
      << bad_json.message();

  write_text(dir.path() / "tokenizer_config.json", R"({"chat_template": 7})");
  Result<ChatTemplate> bad_type = ChatTemplate::load(dir.path());
  ASSERT_FALSE(bad_type.ok());
  EXPECT_NE(bad_type.message().find("\"chat_template\" must be a string or a list"),
            std::string::npos)
      << bad_type.message();

  write_text(dir.path() / "tokenizer_config.json",
             R"({"chat_template": "x", "eos_token": ["</s>"]})");
  Result<ChatTemplate> bad_token = ChatTemplate::load(dir.path());
  ASSERT_FALSE(bad_token.ok());
  EXPECT_NE(bad_token.message().find("\"eos_token\" must be a string"), std::string::npos)
      << bad_token.message();
}

TEST(ChatTemplateLoad, AParseErrorNamesTheFileAndTheLine) {
  TempDir dir;
  write_text(dir.path() / "chat_template.jinja", "line one\n{{ messages | wordwrap }}\n");
  Result<ChatTemplate> chat = ChatTemplate::load(dir.path());
  ASSERT_FALSE(chat.ok());
  EXPECT_NE(chat.message().find("chat_template.jinja: chat template line 2: unsupported filter "
                                "'wordwrap'"),
            std::string::npos)
      << chat.message();
}

// ---- Rendering ----------------------------------------------------------------------------------

TEST(ChatTemplateRender, PassesTheContextTransformersPasses) {
  Result<ChatTemplate> chat = ChatTemplate::from_source(
      "{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}|{{ bos_token is "
      "defined }}|{{ eos_token }}|{{ enable_thinking }}|{{ messages[0].content[0].text }}",
      std::nullopt, "</s>");
  ASSERT_TRUE(chat.ok()) << chat.message();
  ChatRenderOptions options;
  options.add_generation_prompt = false;
  options.extra = ordered_json::parse(R"({"enable_thinking": false})");
  const Result<std::string> out = chat->render(
      ordered_json::parse(R"([{"role": "user", "content": [{"type": "text", "text": "part"}]}])"),
      options);
  ASSERT_TRUE(out.ok()) << out.message();
  EXPECT_EQ(*out, "True|True|False|False|</s>|False|part");
}

TEST(ChatTemplateRender, RefusesMalformedArguments) {
  Result<ChatTemplate> chat = ChatTemplate::from_source("x");
  ASSERT_TRUE(chat.ok());
  EXPECT_EQ(chat->render(ordered_json::object()).status().option(), "messages");
  EXPECT_EQ(chat->render(ordered_json::parse("[1]")).status().option(), "messages");
  ChatRenderOptions tools;
  tools.tools = ordered_json::object();
  EXPECT_EQ(chat->render(ordered_json::array(), tools).status().option(), "tools");
  ChatRenderOptions extra;
  extra.extra = ordered_json::parse(R"({"messages": []})");
  EXPECT_EQ(chat->render(ordered_json::array(), extra).status().option(), "extra");
}

TEST(ChatTemplateRender, RaiseExceptionCarriesTheTemplatesMessage) {
  Result<ChatTemplate> chat = ChatTemplate::from_source(
      "{% if messages | length == 0 %}\n{{ raise_exception('No messages provided.') }}\n{% endif "
      "%}");
  ASSERT_TRUE(chat.ok()) << chat.message();
  const Result<std::string> out = chat->render(ordered_json::array());
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.message(),
            "chat template line 2: the template raised an error: No messages provided.");
}

}  // namespace
}  // namespace e4kv
