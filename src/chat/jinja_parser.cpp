#include "chat/jinja_parser.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "chat/jinja_lexer.h"
#include "core/status.h"

namespace e4kv::jinja {
namespace {

// Tags Jinja2 has that chat templates do not need; named in the refusal.
constexpr std::string_view kUnsupportedTags[] = {"include", "import", "from",      "extends",
                                                 "block",   "call",   "with",      "autoescape",
                                                 "do",      "trans",  "pluralize", "recursive"};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Program run() {
    Program program;
    std::string end_tag;
    program.body = parse_body({}, end_tag);
    return program;
  }

 private:
  // ---- Token helpers ----

  const Token& peek(size_t ahead = 0) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  const Token& next() {
    const Token& token = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return token;
  }
  bool is_op(std::string_view op, size_t ahead = 0) const {
    return peek(ahead).kind == TokenKind::op && peek(ahead).value == op;
  }
  bool is_name(std::string_view name, size_t ahead = 0) const {
    return peek(ahead).kind == TokenKind::name && peek(ahead).value == name;
  }
  static std::string describe(const Token& token) {
    switch (token.kind) {
      case TokenKind::text:
        return "template text";
      case TokenKind::expr_begin:
        return "'{{'";
      case TokenKind::expr_end:
        return "'}}'";
      case TokenKind::block_begin:
        return "'{%'";
      case TokenKind::block_end:
        return "'%}'";
      case TokenKind::string:
        return "a string";
      case TokenKind::end:
        return "the end of the template";
      default:
        return cat("'", token.value, "'");
    }
  }
  [[noreturn]] void unexpected(std::string_view wanted) const {
    fail(peek().line, cat("expected ", wanted, ", got ", describe(peek())));
  }
  void expect_op(std::string_view op) {
    if (!is_op(op)) unexpected(cat("'", op, "'"));
    next();
  }
  std::string expect_name() {
    if (peek().kind != TokenKind::name) unexpected("a name");
    return next().value;
  }
  void expect_block_end() {
    if (peek().kind != TokenKind::block_end) unexpected("'%}'");
    next();
  }

  struct DepthGuard {
    explicit DepthGuard(Parser& p) : parser(p) {
      if (++parser.depth_ > kMaxNesting) {
        fail(parser.peek().line, cat("the template nests deeper than ", kMaxNesting, " levels"));
      }
    }
    ~DepthGuard() { --parser.depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;
    Parser& parser;
  };

  static ExprPtr make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // ---- Statements ----

  // Nodes up to one of `end_tags` (whose `{%` and name are consumed; the name goes to `end_tag`),
  // or to the end of the template when `end_tags` is empty.
  Body parse_body(std::initializer_list<std::string_view> end_tags, std::string& end_tag) {
    DepthGuard guard(*this);
    Body body;
    // The line of the tag that opened this block (the `%}` just consumed).
    const int start_line = pos_ > 0 ? tokens_[pos_ - 1].line : 1;
    while (true) {
      const Token& token = peek();
      if (token.kind == TokenKind::end) {
        if (end_tags.size() == 0) return body;
        std::string wanted;
        for (std::string_view tag : end_tags) wanted += cat(wanted.empty() ? "" : " or ", tag);
        fail(start_line, cat("unexpected end of template: the block opened here needs ", wanted));
      }
      if (token.kind == TokenKind::text) {
        Node node;
        node.kind = Node::Kind::text;
        node.line = token.line;
        node.text = token.value;
        body.push_back(std::move(node));
        next();
      } else if (token.kind == TokenKind::expr_begin) {
        next();
        Node node;
        node.kind = Node::Kind::output;
        node.line = token.line;
        node.expr = parse_tuple_expression();
        if (peek().kind != TokenKind::expr_end) unexpected("'}}'");
        next();
        body.push_back(std::move(node));
      } else if (token.kind == TokenKind::block_begin) {
        next();
        const Token& tag = peek();
        if (tag.kind != TokenKind::name) unexpected("a tag name");
        if (std::find(end_tags.begin(), end_tags.end(), tag.value) != end_tags.end()) {
          end_tag = next().value;
          return body;
        }
        parse_statement(body);
      } else {
        unexpected("template text or a tag");
      }
    }
  }

  void parse_statement(Body& body) {
    const Token tag = next();
    const std::string& name = tag.value;
    Node node;
    node.line = tag.line;
    if (name == "if") {
      body.push_back(parse_if(tag.line));
      return;
    }
    if (name == "for") {
      body.push_back(parse_for(tag.line));
      return;
    }
    if (name == "set") {
      body.push_back(parse_set(tag.line));
      return;
    }
    if (name == "macro") {
      body.push_back(parse_macro(tag.line));
      return;
    }
    if (name == "filter") {
      node.kind = Node::Kind::filter_block;
      node.expr = parse_filter_chain(nullptr);
      expect_block_end();
      std::string end_tag;
      node.body = parse_body({"endfilter"}, end_tag);
      expect_block_end();
      body.push_back(std::move(node));
      return;
    }
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail(tag.line, cat("'", name, "' outside a for loop"));
      node.kind = name == "break" ? Node::Kind::break_ : Node::Kind::continue_;
      expect_block_end();
      body.push_back(std::move(node));
      return;
    }
    if (name == "generation") {
      // transformers' {% generation %} marks assistant text for masks; it renders its body.
      expect_block_end();
      std::string end_tag;
      Body inner = parse_body({"endgeneration"}, end_tag);
      expect_block_end();
      for (Node& n : inner) body.push_back(std::move(n));
      return;
    }
    for (std::string_view unsupported : kUnsupportedTags) {
      if (name == unsupported) fail(tag.line, cat("unsupported tag '", name, "'"));
    }
    if (name.starts_with("end") || name == "elif" || name == "else") {
      fail(tag.line, cat("unexpected tag '", name, "'"));
    }
    fail(tag.line, cat("unsupported tag '", name, "'"));
  }

  Node parse_if(int line) {
    Node node;
    node.kind = Node::Kind::if_;
    node.line = line;
    node.expr = parse_expression();
    expect_block_end();
    std::string end_tag;
    node.body = parse_body({"elif", "else", "endif"}, end_tag);
    if (end_tag == "elif") {
      node.else_body.push_back(parse_if(peek().line));
    } else if (end_tag == "else") {
      expect_block_end();
      node.else_body = parse_body({"endif"}, end_tag);
      expect_block_end();
    } else {
      expect_block_end();
    }
    return node;
  }

  Node parse_for(int line) {
    Node node;
    node.kind = Node::Kind::for_;
    node.line = line;
    const bool parenthesized = is_op("(");
    if (parenthesized) next();
    node.targets.push_back(expect_name());
    while (is_op(",")) {
      next();
      if (peek().kind != TokenKind::name || is_name("in")) break;
      node.targets.push_back(expect_name());
    }
    if (parenthesized) expect_op(")");
    if (!is_name("in")) unexpected("'in'");
    next();
    node.expr = parse_expression(/*with_condexpr=*/false);
    if (is_name("if")) {
      next();
      node.filter = parse_expression();
    }
    if (is_name("recursive"))
      fail(peek().line, "unsupported tag 'recursive' (recursive for loops)");
    expect_block_end();
    ++loop_depth_;
    std::string end_tag;
    node.body = parse_body({"else", "endfor"}, end_tag);
    --loop_depth_;
    if (end_tag == "else") {
      expect_block_end();
      node.else_body = parse_body({"endfor"}, end_tag);
    }
    expect_block_end();
    return node;
  }

  Node parse_set(int line) {
    Node node;
    node.line = line;
    const int target_line = peek().line;
    std::string first = expect_name();
    if (is_op(".")) {
      next();
      node.target = make(Expr::Kind::getattr, target_line);
      node.target->a = make(Expr::Kind::name, target_line);
      node.target->a->name = std::move(first);
      node.target->name = expect_name();
    } else if (is_op(",")) {
      node.target = make(Expr::Kind::tuple, target_line);
      auto item = make(Expr::Kind::name, target_line);
      item->name = std::move(first);
      node.target->items.push_back(std::move(item));
      while (is_op(",")) {
        next();
        if (peek().kind != TokenKind::name) break;
        auto more = make(Expr::Kind::name, peek().line);
        more->name = expect_name();
        node.target->items.push_back(std::move(more));
      }
    } else {
      node.target = make(Expr::Kind::name, target_line);
      node.target->name = std::move(first);
    }
    if (is_op("=")) {
      next();
      node.kind = Node::Kind::set;
      node.expr = parse_tuple_expression();
      expect_block_end();
      return node;
    }
    if (node.target->kind != Expr::Kind::name) {
      fail(line, "a block {% set %} assigns to a single name");
    }
    node.kind = Node::Kind::set_block;
    if (is_op("|")) node.expr = parse_filter_chain(nullptr, /*leading_pipe=*/true);
    expect_block_end();
    std::string end_tag;
    node.body = parse_body({"endset"}, end_tag);
    expect_block_end();
    return node;
  }

  Node parse_macro(int line) {
    Node node;
    node.kind = Node::Kind::macro;
    node.line = line;
    node.name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      std::string param = expect_name();
      if (std::find(node.params.begin(), node.params.end(), param) != node.params.end()) {
        fail(peek().line, cat("macro '", node.name, "' repeats the parameter '", param, "'"));
      }
      ExprPtr default_value;
      if (is_op("=")) {
        next();
        default_value = parse_expression();
      } else if (!node.defaults.empty() && node.defaults.back() != nullptr) {
        fail(peek().line, "a parameter without a default follows one with a default");
      }
      node.params.push_back(std::move(param));
      node.defaults.push_back(std::move(default_value));
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
    expect_block_end();
    // A loop outside the macro does not make `break` valid inside it.
    const int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;
    std::string end_tag;
    node.body = parse_body({"endmacro"}, end_tag);
    loop_depth_ = saved_loop_depth;
    if (peek().kind == TokenKind::name && peek().value == node.name) next();
    expect_block_end();
    return node;
  }

  // ---- Expressions ----

  // An expression, or an unparenthesized tuple of them (`{% set a, b = 1, 2 %}`).
  ExprPtr parse_tuple_expression() {
    const int line = peek().line;
    ExprPtr first = parse_expression();
    if (!is_op(",")) return first;
    auto tuple = make(Expr::Kind::tuple, line);
    tuple->items.push_back(std::move(first));
    while (is_op(",")) {
      next();
      if (peek().kind == TokenKind::block_end || peek().kind == TokenKind::expr_end) break;
      tuple->items.push_back(parse_expression());
    }
    return tuple;
  }

  ExprPtr parse_expression(bool with_condexpr = true) {
    DepthGuard guard(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      const int line = next().line;
      auto cond = make(Expr::Kind::conditional, line);
      cond->a = std::move(expr);
      cond->b = parse_or();
      if (is_name("else")) {
        next();
        cond->c = parse_condexpr();
      }
      expr = std::move(cond);
    }
    return expr;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      auto node = make(Expr::Kind::logical, next().line);
      node->name = "or";
      node->a = std::move(left);
      node->b = parse_and();
      left = std::move(node);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      auto node = make(Expr::Kind::logical, next().line);
      node->name = "and";
      node->a = std::move(left);
      node->b = parse_not();
      left = std::move(node);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this);
      auto node = make(Expr::Kind::unary, next().line);
      node->name = "not";
      node->a = parse_not();
      return node;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    ExprPtr left = parse_math1();
    bool compared = false;
    while (true) {
      std::string op;
      const int line = peek().line;
      if (peek().kind == TokenKind::op &&
          (peek().value == "==" || peek().value == "!=" || peek().value == "<" ||
           peek().value == "<=" || peek().value == ">" || peek().value == ">=")) {
        op = next().value;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "not in";
      } else {
        return left;
      }
      if (compared) fail(line, "unsupported chained comparison (write it with 'and')");
      compared = true;
      auto node = make(Expr::Kind::binary, line);
      node->name = op;
      node->a = std::move(left);
      node->b = parse_math1();
      left = std::move(node);
    }
  }

  ExprPtr parse_binary_level(ExprPtr (Parser::*operand)(),
                             std::initializer_list<std::string_view> ops) {
    ExprPtr left = (this->*operand)();
    while (peek().kind == TokenKind::op &&
           std::find(ops.begin(), ops.end(), peek().value) != ops.end()) {
      auto node = make(Expr::Kind::binary, peek().line);
      node->name = next().value;
      node->a = std::move(left);
      node->b = (this->*operand)();
      left = std::move(node);
    }
    return left;
  }
  ExprPtr parse_math1() { return parse_binary_level(&Parser::parse_concat, {"+", "-"}); }
  ExprPtr parse_concat() { return parse_binary_level(&Parser::parse_math2, {"~"}); }
  ExprPtr parse_math2() { return parse_binary_level(&Parser::parse_pow, {"*", "/", "//", "%"}); }
  ExprPtr parse_pow() { return parse_binary_level(&Parser::parse_unary_with_filter, {"**"}); }
  ExprPtr parse_unary_with_filter() { return parse_unary(true); }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      node = make(Expr::Kind::unary, peek().line);
      node->name = next().value;
      node->a = parse_unary(false);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& token = peek();
    const int line = token.line;
    switch (token.kind) {
      case TokenKind::name: {
        const std::string& name = next().value;
        auto node = make(Expr::Kind::literal, line);
        if (name == "true" || name == "True") {
          node->value = Value::boolean(true);
        } else if (name == "false" || name == "False") {
          node->value = Value::boolean(false);
        } else if (name == "none" || name == "None") {
          node->value = Value::none();
        } else {
          node->kind = Expr::Kind::name;
          node->name = name;
        }
        return node;
      }
      case TokenKind::string: {
        std::string text = next().value;
        while (peek().kind == TokenKind::string) text += next().value;
        auto node = make(Expr::Kind::literal, line);
        node->value = Value::string(std::move(text));
        return node;
      }
      case TokenKind::integer: {
        const std::string digits = next().value;
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(digits.c_str(), &end, 10);
        if (errno == ERANGE) fail(line, cat("integer literal ", digits, " is out of range"));
        auto node = make(Expr::Kind::literal, line);
        node->value = Value::integer(static_cast<int64_t>(v));
        return node;
      }
      case TokenKind::floating: {
        auto node = make(Expr::Kind::literal, line);
        node->value = Value::floating(std::strtod(next().value.c_str(), nullptr));
        return node;
      }
      case TokenKind::op:
        if (token.value == "(") {
          next();
          if (is_op(")")) {
            next();
            return make(Expr::Kind::tuple, line);
          }
          ExprPtr first = parse_expression();
          if (!is_op(",")) {
            expect_op(")");
            return first;
          }
          auto tuple = make(Expr::Kind::tuple, line);
          tuple->items.push_back(std::move(first));
          while (is_op(",")) {
            next();
            if (is_op(")")) break;
            tuple->items.push_back(parse_expression());
          }
          expect_op(")");
          return tuple;
        }
        if (token.value == "[") {
          next();
          auto list = make(Expr::Kind::list, line);
          while (!is_op("]")) {
            list->items.push_back(parse_expression());
            if (!is_op(",")) break;
            next();
          }
          expect_op("]");
          return list;
        }
        if (token.value == "{") {
          next();
          auto dict = make(Expr::Kind::dict, line);
          while (!is_op("}")) {
            dict->items.push_back(parse_expression());
            expect_op(":");
            dict->items.push_back(parse_expression());
            if (!is_op(",")) break;
            next();
          }
          expect_op("}");
          return dict;
        }
        break;
      default:
        break;
    }
    unexpected("an expression");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      const int line = peek().line;
      if (is_op(".")) {
        next();
        if (peek().kind == TokenKind::name) {
          auto attr = make(Expr::Kind::getattr, line);
          attr->a = std::move(node);
          attr->name = next().value;
          node = std::move(attr);
        } else if (peek().kind == TokenKind::integer) {
          auto item = make(Expr::Kind::getitem, line);
          item->a = std::move(node);
          item->b = make(Expr::Kind::literal, line);
          item->b->value = Value::integer(std::strtoll(next().value.c_str(), nullptr, 10));
          node = std::move(item);
        } else {
          unexpected("an attribute name");
        }
      } else if (is_op("[")) {
        next();
        node = parse_subscript(std::move(node), line);
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object, int line) {
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression();
      if (is_op("]")) {
        next();
        auto item = make(Expr::Kind::getitem, line);
        item->a = std::move(object);
        item->b = std::move(start);
        return item;
      }
      if (is_op(",")) fail(line, "unsupported tuple subscript");
    }
    auto slice = make(Expr::Kind::slice, line);
    slice->a = std::move(object);
    slice->b = std::move(start);
    expect_op(":");
    if (!is_op("]") && !is_op(":")) slice->c = parse_expression();
    if (is_op(":")) {
      next();
      if (!is_op("]")) slice->d = parse_expression();
    }
    expect_op("]");
    return slice;
  }

  // `(args)` after a callee, a filter or a test.
  void parse_call_args(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) fail(peek().line, "unsupported argument unpacking (* or **)");
      if (peek().kind == TokenKind::name && is_op("=", 1)) {
        std::string key = next().value;
        next();
        call.kwargs.emplace_back(std::move(key), parse_expression());
      } else {
        if (!call.kwargs.empty()) {
          fail(peek().line, "a positional argument follows a keyword argument");
        }
        call.items.push_back(parse_expression());
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto call = make(Expr::Kind::call, peek().line);
    call->a = std::move(callee);
    parse_call_args(*call);
    return call;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter_chain(std::move(node), /*leading_pipe=*/true, /*single=*/true);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  // `f(args) | g | h(args)` applied to `operand` (null: a filter block's body).
  ExprPtr parse_filter_chain(ExprPtr operand, bool leading_pipe = false, bool single = false) {
    bool first = true;
    while (true) {
      if (!first || leading_pipe) {
        if (!is_op("|")) return operand;
        next();
      }
      first = false;
      const int line = peek().line;
      std::string name = expect_name();
      while (is_op(".")) {  // dotted filter names are not builtins; keep them for the message
        next();
        name += "." + expect_name();
      }
      if (!is_known_filter(name)) fail(line, cat("unsupported filter '", name, "'"));
      auto filter = make(Expr::Kind::filter, line);
      filter->name = std::move(name);
      filter->a = std::move(operand);
      if (is_op("(")) parse_call_args(*filter);
      operand = std::move(filter);
      if (single) return operand;
    }
  }

  ExprPtr parse_test(ExprPtr operand) {
    const int line = next().line;  // `is`
    auto test = make(Expr::Kind::test, line);
    test->a = std::move(operand);
    if (is_name("not")) {
      next();
      test->negated = true;
    }
    const Token& name_token = peek();
    if (name_token.kind != TokenKind::name) unexpected("a test name");
    test->name = next().value;
    if (!is_known_test(test->name)) fail(line, cat("unsupported test '", test->name, "'"));
    if (is_op("(")) {
      parse_call_args(*test);
    } else {
      const Token& arg = peek();
      const bool starts_arg = (arg.kind == TokenKind::name && arg.value != "else" &&
                               arg.value != "or" && arg.value != "and" && arg.value != "is" &&
                               arg.value != "if" && arg.value != "in" && arg.value != "not") ||
                              arg.kind == TokenKind::string || arg.kind == TokenKind::integer ||
                              arg.kind == TokenKind::floating ||
                              (arg.kind == TokenKind::op && (arg.value == "[" || arg.value == "{"));
      if (starts_arg) test->items.push_back(parse_postfix(parse_primary()));
    }
    return test;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

Program parse_template(std::string_view source) {
  return Parser(tokenize(source)).run();
}

}  // namespace e4kv::jinja
