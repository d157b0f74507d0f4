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
  if (!context.is_object()) {
    return Status::error(
        cat(what_, ": the render context must be a JSON object, got ", context.type_name()));
  }
  try {
    const jinja::Value variables = jinja::Value::from_json(context);
    jinja::Interpreter interpreter(limits);
    return interpreter.render(*program_, variables.as_object());
  } catch (const jinja::TemplateError& error) {
    return template_status(what_, error);
  }
}

}  // namespace e4kv
