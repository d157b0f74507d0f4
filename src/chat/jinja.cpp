#include "chat/jinja.h"

#include "chat/jinja_parser.h"

namespace e4kv {
namespace {

// The engine reports errors as TemplateError (the line and the reason), thrown from deep inside
// the recursive parser and interpreter; here, at the API boundary, they become a Status.
Status template_status(const std::string& what, const jinja::TemplateError& error) {
  if (error.line > 0) return Status::error(cat(what, " line ", error.line, ": ", error.message));
  return Status::error(cat(what, ": ", error.message));
}

}  // namespace

Result<JinjaTemplate> JinjaTemplate::parse(std::string_view source, std::string what) {
  try {
    auto program = std::make_shared<const jinja::Program>(jinja::parse_template(source));
    return JinjaTemplate(std::move(program), std::move(what));
  } catch (const jinja::TemplateError& error) {
    return template_status(what, error);
  }
}

Result<std::string> JinjaTemplate::render(const nlohmann::ordered_json& context,
                                          const JinjaLimits& limits) const {
  E4KV_ASSIGN_OR_RETURN(jinja::TrackedText text,
                        render_tracked(context, nlohmann::ordered_json::object(), limits));
  return std::move(text.text);
}

Result<jinja::TrackedText> JinjaTemplate::render_tracked(const nlohmann::ordered_json& trusted,
                                                         const nlohmann::ordered_json& untrusted,
                                                         const JinjaLimits& limits) const {
  for (const nlohmann::ordered_json* context : {&trusted, &untrusted}) {
    if (!context->is_object()) {
      return Status::error(
          cat(what_, ": the render context must be a JSON object, got ", context->type_name()));
    }
  }
  try {
    jinja::ObjectData variables;
    for (const auto& [key, value] : trusted.items()) {
      variables.set(key, jinja::Value::from_json(value, /*untrusted=*/false, 1));
    }
    for (const auto& [key, value] : untrusted.items()) {
      if (trusted.contains(key)) {
        return Status::error(cat(what_, ": the variable \"", key, "\" is given twice"));
      }
      variables.set(key, jinja::Value::from_json(value, /*untrusted=*/true, 1));
    }
    jinja::Interpreter interpreter(limits);
    return interpreter.render(*program_, variables);
  } catch (const jinja::TemplateError& error) {
    return template_status(what_, error);
  }
}

}  // namespace e4kv
