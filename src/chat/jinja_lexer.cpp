#include "chat/jinja_lexer.h"

#include <cctype>

#include "chat/jinja_value.h"
#include "core/status.h"
#include "core/utf8.h"

namespace e4kv::jinja {
namespace {

// The text without trailing whitespace (Python's str.rstrip(), what `{%-` does).
void strip_trailing_space(std::string& text) {
  size_t end = text.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
    const Utf8Step step = utf8_step(text, start);
    if (!step.valid || start + step.length != end ||
        !is_python_space(utf8_decode(text, start, step.length))) {
      break;
    }
    end = start;
  }
  text.resize(end);
}

// The position after the whitespace starting at `pos` (what `-%}` skips).
size_t skip_space(std::string_view text, size_t pos) {
  while (pos < text.size()) {
    const Utf8Step step = utf8_step(text, pos);
    if (!step.valid || !is_python_space(utf8_decode(text, pos, step.length))) break;
    pos += step.length;
  }
  return pos;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  std::vector<Token> run() {
    bool strip_next_text = false;  // a `-%}` / `-}}` / `-#}` before it
    while (pos_ < src_.size()) {
      if (strip_next_text) {
        advance_to(skip_space(src_, pos_));
        strip_next_text = false;
      }
      const size_t tag = find_tag(pos_);
      std::string text = src_.substr(pos_, tag - pos_);
      const int text_line = line_;
      advance_to(tag);
      if (tag == src_.size()) {
        emit_text(std::move(text), text_line);
        break;
      }
      const char type = src_[tag + 1];  // '{', '%' or '#'
      const char modifier = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      if (modifier == '-') {
        strip_trailing_space(text);
      } else if (type != '{' && modifier != '+') {
        lstrip_block(text, tag);
      }
      emit_text(std::move(text), text_line);
      advance_to(tag + 2 + (modifier == '-' || modifier == '+' ? 1 : 0));
      if (type == '#') {
        strip_next_text = lex_comment();
      } else if (type == '%' && is_raw_block()) {
        strip_next_text = lex_raw();
      } else {
        strip_next_text = lex_tag(type == '%');
      }
    }
    tokens_.push_back(Token{TokenKind::end, "", line_});
    return std::move(tokens_);
  }

 private:
  // The start of the next `{{`, `{%` or `{#`, or the end of the source.
  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) {
        return p;
      }
    }
    return src_.size();
  }

  void advance_to(size_t target) {
    for (; pos_ < target; ++pos_) {
      if (src_[pos_] == '\n') ++line_;
    }
  }

  // lstrip_blocks: spaces and tabs between the start of the line and a block or comment tag.
  void lstrip_block(std::string& text, size_t tag) const {
    const size_t newline = text.rfind('\n');
    const size_t tail = newline == std::string::npos ? 0 : newline + 1;
    if (newline == std::string::npos) {
      const size_t text_start = tag - text.size();
      if (text_start != 0 && src_[text_start - 1] != '\n') return;
    }
    for (size_t i = tail; i < text.size(); ++i) {
      if (text[i] != ' ' && text[i] != '\t') return;
    }
    text.resize(tail);
  }

  void emit_text(std::string text, int line) {
    if (!text.empty()) tokens_.push_back(Token{TokenKind::text, std::move(text), line});
  }

  // trim_blocks: a single newline right after a block or comment tag.
  void trim_block_newline() {
    if (pos_ < src_.size() && src_[pos_] == '\n') advance_to(pos_ + 1);
  }

  // After `{#`: skips to `#}`; returns whether it was `-#}`.
  bool lex_comment() {
    const int start_line = line_;
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) fail(start_line, "unterminated comment: missing '#}'");
    const bool strip = end > pos_ && src_[end - 1] == '-';
    advance_to(end + 2);
    if (!strip) trim_block_newline();
    return strip;
  }

  bool is_raw_block() const {
    size_t p = pos_;
    while (p < src_.size() && (src_[p] == ' ' || src_[p] == '\t' || src_[p] == '\n')) ++p;
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    while (p < src_.size() && (src_[p] == ' ' || src_[p] == '\t' || src_[p] == '\n')) ++p;
    return src_.compare(p, 2, "%}") == 0 || src_.compare(p, 3, "-%}") == 0;
  }

  // After `{%` of `{% raw %}`: the text up to `{% endraw %}` is passed through as is.
  bool lex_raw() {
    const int start_line = line_;
    size_t close = src_.find("%}", pos_);
    const bool strip_inner_start = src_[close - 1] == '-';
    advance_to(close + 2);
    // Jinja2 applies no trim_blocks inside {% raw %}: only `-%}` strips there.
    if (strip_inner_start) advance_to(skip_space(src_, pos_));
    for (size_t p = src_.find("{%", pos_); p != std::string::npos; p = src_.find("{%", p + 2)) {
      size_t q = p + 2;
      const bool strip_before = q < src_.size() && src_[q] == '-';
      if (strip_before || (q < src_.size() && src_[q] == '+')) ++q;
      while (q < src_.size() && (src_[q] == ' ' || src_[q] == '\t' || src_[q] == '\n')) ++q;
      if (src_.compare(q, 6, "endraw") != 0) continue;
      q += 6;
      while (q < src_.size() && (src_[q] == ' ' || src_[q] == '\t' || src_[q] == '\n')) ++q;
      const bool strip_after = src_.compare(q, 3, "-%}") == 0;
      if (!strip_after && src_.compare(q, 2, "%}") != 0) continue;
      std::string text = src_.substr(pos_, p - pos_);
      if (strip_before) strip_trailing_space(text);
      emit_text(std::move(text), line_);
      advance_to(q + (strip_after ? 3 : 2));
      if (!strip_after) trim_block_newline();
      return strip_after;
    }
    fail(start_line, "unterminated {% raw %} block: missing {% endraw %}");
  }

  // After `{{` or `{%`: the expression tokens up to the closing `}}` / `%}` (not counted inside
  // brackets). Returns whether the tag ended with `-`.
  bool lex_tag(bool block) {
    const int start_line = line_;
    tokens_.push_back(Token{block ? TokenKind::block_begin : TokenKind::expr_begin, "", line_});
    const std::string_view close = block ? "%}" : "}}";
    int depth = 0;
    while (true) {
      while (pos_ < src_.size() &&
             (src_[pos_] == ' ' || src_[pos_] == '\t' || src_[pos_] == '\n' || src_[pos_] == '\r' ||
              src_[pos_] == '\f' || src_[pos_] == '\v')) {
        advance_to(pos_ + 1);
      }
      if (pos_ >= src_.size()) {
        fail(start_line, cat("unexpected end of template: missing '", close, "'"));
      }
      if (depth == 0) {
        const bool strip = src_[pos_] == '-' && src_.compare(pos_ + 1, 2, close) == 0;
        if (strip || src_.compare(pos_, 2, close) == 0) {
          tokens_.push_back(Token{block ? TokenKind::block_end : TokenKind::expr_end, "", line_});
          advance_to(pos_ + (strip ? 3 : 2));
          if (block && !strip) trim_block_newline();
          return strip;
        }
      }
      lex_expression_token(depth);
    }
  }

  void lex_expression_token(int& depth) {
    const char c = src_[pos_];
    const int line = line_;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t end = pos_;
      while (end < src_.size() &&
             (std::isalnum(static_cast<unsigned char>(src_[end])) || src_[end] == '_')) {
        ++end;
      }
      tokens_.push_back(Token{TokenKind::name, src_.substr(pos_, end - pos_), line});
      advance_to(end);
      return;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      lex_number();
      return;
    }
    if (c == '\'' || c == '"') {
      lex_string(c);
      return;
    }
    static constexpr std::string_view kTwoChar[] = {"//", "**", "==", "!=", "<=", ">="};
    for (std::string_view op : kTwoChar) {
      if (src_.compare(pos_, 2, op) == 0) {
        tokens_.push_back(Token{TokenKind::op, std::string(op), line});
        advance_to(pos_ + 2);
        return;
      }
    }
    static constexpr std::string_view kOneChar = "+-*/%~<>=()[]{},.:|";
    if (kOneChar.find(c) != std::string_view::npos) {
      if (c == '(' || c == '[' || c == '{') ++depth;
      if (c == ')' || c == ']' || c == '}') {
        if (depth == 0) fail(line, cat("unexpected '", c, "'"));
        --depth;
      }
      tokens_.push_back(Token{TokenKind::op, std::string(1, c), line});
      advance_to(pos_ + 1);
      return;
    }
    fail(line, cat("unexpected character '", c, "'"));
  }

  void lex_number() {
    const int line = line_;
    auto digits = [&](size_t p) {
      while (p < src_.size() &&
             (std::isdigit(static_cast<unsigned char>(src_[p])) || src_[p] == '_')) {
        ++p;
      }
      return p;
    };
    size_t end = digits(pos_);
    bool is_float = false;
    // Not after a dot: `x.0.1` is two integer subscripts, not a float.
    const bool after_dot =
        !tokens_.empty() && tokens_.back().kind == TokenKind::op && tokens_.back().value == ".";
    if (!after_dot && end + 1 < src_.size() && src_[end] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[end + 1]))) {
      end = digits(end + 1);
      is_float = true;
    }
    if (!after_dot && end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t p = end + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p]))) {
        end = digits(p);
        is_float = true;
      }
    }
    std::string text;
    for (size_t p = pos_; p < end; ++p) {
      if (src_[p] != '_') text += src_[p];
    }
    tokens_.push_back(Token{is_float ? TokenKind::floating : TokenKind::integer, text, line});
    advance_to(end);
  }

  // A string literal with Python's escapes (\n \t \\ \' \" \xhh \uXXXX \UXXXXXXXX, octal); an
  // unknown escape keeps its backslash, as Python does.
  void lex_string(char quote) {
    const int line = line_;
    std::string value;
    size_t p = pos_ + 1;
    while (true) {
      if (p >= src_.size()) fail(line, "unterminated string literal");
      const char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) fail(line, "unterminated string literal");
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n':
          break;
        case '\\':
        case '\'':
        case '"':
          value += e;
          break;
        case 'n':
          value += '\n';
          break;
        case 't':
          value += '\t';
          break;
        case 'r':
          value += '\r';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case 'v':
          value += '\v';
          break;
        case 'a':
          value += '\a';
          break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t width = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
          if (p + width > src_.size()) fail(line, cat("truncated \\", e, " escape"));
          char32_t cp = 0;
          for (size_t k = 0; k < width; ++k) {
            const char h = src_[p + k];
            if (!std::isxdigit(static_cast<unsigned char>(h))) {
              fail(line, cat("truncated \\", e, " escape"));
            }
            cp = cp * 16 + static_cast<char32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                     ? h - '0'
                                                     : std::tolower(h) - 'a' + 10);
          }
          if (cp > 0x10FFFF) fail(line, "escape beyond U+10FFFF");
          append_utf8(value, cp);
          p += width;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            char32_t cp = static_cast<char32_t>(e - '0');
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k) {
              cp = cp * 8 + static_cast<char32_t>(src_[p++] - '0');
            }
            append_utf8(value, cp);
          } else {
            value += '\\';
            value += e;
          }
      }
    }
    tokens_.push_back(Token{TokenKind::string, std::move(value), line});
    advance_to(p + 1);
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) {
  // Jinja2 reads \r\n and \r as \n and drops one trailing newline (keep_trailing_newline=False).
  std::string normalized;
  normalized.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      normalized += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      normalized += source[i];
    }
  }
  if (!normalized.empty() && normalized.back() == '\n') normalized.pop_back();
  return Lexer(std::move(normalized)).run();
}

}  // namespace e4kv::jinja
