// Splits a Jinja template into text and tag tokens, applying whitespace control as transformers
// configures Jinja2 for chat templates: trim_blocks (the newline after a block or comment tag is
// dropped), lstrip_blocks (spaces and tabs before a block or comment tag at the start of a line are
// dropped), the `-` modifiers ({%- -%} {{- -}} {#- -#}) that strip all whitespace on their side,
// `+` that keeps it, a single trailing newline of the template dropped, newlines normalised to \n,
// and {% raw %} blocks passed through.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace e4kv::jinja {

enum class TokenKind {
  text,         // template data between tags
  expr_begin,   // {{
  expr_end,     // }}
  block_begin,  // {%
  block_end,    // %}
  name,
  string,   // value: the decoded literal
  integer,  // value: the digits
  floating,
  op,  // + - * / // % ** ~ == != < <= > >= = ( ) [ ] { } , . : |
  end,
};

struct Token {
  TokenKind kind = TokenKind::end;
  std::string value;
  int line = 1;
};

// Throws TemplateError on an unterminated tag, comment or string, or an unknown character.
std::vector<Token> tokenize(std::string_view source);

}  // namespace e4kv::jinja
