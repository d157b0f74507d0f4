// The Jinja engine on small templates whose output is computed by hand (and agrees with Python's
// Jinja2 3.1 configured as transformers configures it): statements, loops and loop variables,
// scoping, namespaces, macros, filters, tests, methods, operators, slicing, whitespace control,
// tojson, undefined values, and the errors and limits.
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "chat/jinja.h"
#include "chat/jinja_value.h"

namespace e4kv {
namespace {

using ordered_json = nlohmann::ordered_json;

Result<std::string> try_render(const std::string& source, const std::string& context_json = "{}",
                               const JinjaLimits& limits = {}) {
  E4KV_ASSIGN_OR_RETURN(JinjaTemplate tpl, JinjaTemplate::parse(source));
  return tpl.render(ordered_json::parse(context_json), limits);
}

std::string render(const std::string& source, const std::string& context_json = "{}") {
  const Result<std::string> out = try_render(source, context_json);
  EXPECT_TRUE(out.ok()) << "template: " << source << "\nerror: " << out.message();
  return out.ok() ? *out : "<error>";
}

std::string error_of(const std::string& source, const std::string& context_json = "{}",
                     const JinjaLimits& limits = {}) {
  const Result<std::string> out = try_render(source, context_json, limits);
  EXPECT_FALSE(out.ok()) << "template: " << source << "\nrendered: " << (out.ok() ? *out : "");
  return out.ok() ? "" : out.message();
}

// ---- Text, expressions and values ---------------------------------------------------------------

TEST(Jinja, PrintsValuesAsPythonDoes) {
  EXPECT_EQ(render("{{ 'a' }}|{{ 1 }}|{{ 2.5 }}|{{ 1.0 }}|{{ true }}|{{ none }}|{{ x }}|"),
            "a|1|2.5|1.0|True|None||");
  EXPECT_EQ(render("{{ [1, 'a', none, true] }}|{{ {'k': 'v', 'n': 1.5} }}|{{ (1, 2) }}|{{ (1,) }}"),
            "[1, 'a', None, True]|{'k': 'v', 'n': 1.5}|(1, 2)|(1,)");
  EXPECT_EQ(render("{{ \"it's\" }}|{{ ['it\\'s', 'a\"b', 'tab\\t'] }}"),
            "it's|[\"it's\", 'a\"b', 'tab\\t']");
  EXPECT_EQ(render("{{ 1e20 }}|{{ 1/3 }}|{{ 0.1 + 0.2 }}|{{ 1e-5 }}|{{ 1e16 }}|{{ 123456.0 }}"),
            "1e+20|0.3333333333333333|0.30000000000000004|1e-05|1e+16|123456.0");
  EXPECT_EQ(render("{{ x }}", R"({"x": {"a": [1, {"b": null}], "c": "é"}})"),
            "{'a': [1, {'b': None}], 'c': 'é'}");
}

TEST(Jinja, Arithmetic) {
  EXPECT_EQ(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7 / 2 }} {{ 4 / 2 }}"),
            "3 -4 2 -2 3.5 2.0");
  EXPECT_EQ(render("{{ 2 ** 10 }} {{ 2 ** -1 }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ -2 ** 2 }}"),
            "1024 0.5 7 9 4");
  EXPECT_EQ(render("{{ 1 + 1.5 }} {{ true + 1 }} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ [1] + [2] }}"),
            "2.5 2 ababab [1, 1] [1, 2]");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none ~ true ~ undefined_name ~ 2.0 }}"), "a1NoneTrue2.0");
  EXPECT_EQ(render("{{ 'a' + 'b' }}"), "ab");
  EXPECT_NE(error_of("{{ 'a' + 1 }}").find("can only concatenate str (not \"int\") to str"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 1 / 0 }}").find("division by zero"), std::string::npos);
  EXPECT_NE(error_of("{{ 9223372036854775807 + 1 }}").find("integer overflow"), std::string::npos);
}

TEST(Jinja, ComparisonsAndLogic) {
  EXPECT_EQ(
      render("{{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 3 }}"),
      "True True True True False");
  EXPECT_EQ(render("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}"),
            "True True True True");
  EXPECT_EQ(render("{{ 0 or 'x' }} {{ 1 and 'y' }} {{ [] or {} }} {{ not '' }} {{ none and 1 }}"),
            "x y {} True None");
  EXPECT_EQ(render("{{ 'a' if x else 'b' }}{{ 'c' if true }}{{ 'd' if false }}"), "bc");
  EXPECT_EQ(render("{{ not x is defined }}|{{ x is not defined and 1 }}"), "True|1");
  EXPECT_EQ(render("{{ {'a': 1} == {'a': 1.0} }} {{ [1, [2]] == [1, [2]] }} {{ 'a' == 1 }}"),
            "True True False");
  EXPECT_NE(
      error_of("{{ 1 < 'a' }}").find("'<' not supported between instances of 'int' and 'str'"),
      std::string::npos);
}

TEST(Jinja, SubscriptsAttributesAndSlices) {
  const std::string ctx =
      R"({"m": {"role": "user", "items": 5}, "xs": [10, 20, 30, 40], "s": "héllo"})";
  EXPECT_EQ(
      render("{{ m.role }} {{ m['role'] }} {{ xs[0] }} {{ xs[-1] }} {{ xs.1 }} {{ s[1] }}", ctx),
      "user user 10 40 20 é");
  EXPECT_EQ(render("{{ xs[1:3] }} {{ xs[::-1] }} {{ xs[:-2] }} {{ xs[::2] }} {{ xs[5:] }}", ctx),
            "[20, 30] [40, 30, 20, 10] [10, 20] [10, 30] []");
  EXPECT_EQ(render("{{ s[1:3] }}|{{ s[::-1] }}|{{ s[-2:] }}", ctx), "él|olléh|lo");
  // A dict's methods shadow its keys for attribute access, not for subscripts (Python getattr).
  EXPECT_EQ(render("{{ m['items'] }} {{ m.items is callable }}", ctx), "5 True");
  EXPECT_EQ(
      render("[{{ m.missing }}][{{ xs[9] }}][{{ m.missing.deeper }}][{{ nothing.at.all }}]", ctx),
      "[][][][]");
}

// ---- Statements ---------------------------------------------------------------------------------

TEST(Jinja, IfElifElse) {
  const std::string t =
      "{% if n == 1 %}one{% elif n == 2 %}two{% elif n == 3 %}three{% else %}many{% endif %}";
  EXPECT_EQ(render(t, R"({"n": 1})"), "one");
  EXPECT_EQ(render(t, R"({"n": 3})"), "three");
  EXPECT_EQ(render(t, R"({"n": 9})"), "many");
}

TEST(Jinja, ForLoopVariables) {
  EXPECT_EQ(
      render("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
             "{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
             R"({"xs": ["a", "b"]})"),
      "1021TrueFalse2;2110FalseTrue2;");
  EXPECT_EQ(render("{% for x in xs %}[{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}]{% endfor %}",
                   R"({"xs": [1, 2, 3]})"),
            "[<1>2][1<2>3][2<3>]");
  EXPECT_EQ(render("{% for x in xs %}{{ loop.cycle('odd', 'even') }} {% endfor %}",
                   R"({"xs": [1, 2, 3]})"),
            "odd even odd ");
}

TEST(Jinja, ForLoopFormsAndElse) {
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                   R"({"d": {"b": 1, "a": 2}})"),
            "b=1;a=2;");
  EXPECT_EQ(render("{% for k in d %}{{ k }}{% endfor %}", R"({"d": {"x": 1, "y": 2}})"), "xy");
  EXPECT_EQ(render("{% for c in 'héj' %}{{ c }}.{% endfor %}"), "h.é.j.");
  EXPECT_EQ(render("{% for x in xs if x is odd %}{{ x }}{{ loop.length }},{% endfor %}",
                   R"({"xs": [1, 2, 3, 4, 5]})"),
            "13,33,53,");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for x in undefined_list %}x{% else %}none{% endfor %}"), "none");
  EXPECT_EQ(render("{% for (a, b) in [[1, 2], [3, 4]] %}{{ a + b }} {% endfor %}"), "3 7 ");
  EXPECT_NE(error_of("{% for a, b in [[1, 2, 3]] %}{% endfor %}").find("too many values to unpack"),
            std::string::npos);
  EXPECT_NE(error_of("{% for x in 5 %}{% endfor %}").find("'int' object is not iterable"),
            std::string::npos);
}

TEST(Jinja, BreakAndContinue) {
  EXPECT_EQ(render("{% for x in range(10) %}{% if x == 4 %}{% break %}{% endif %}"
                   "{% if x is even %}{% continue %}{% endif %}{{ x }}{% endfor %}"),
            "13");
}

TEST(Jinja, ScopingFollowsJinja2) {
  // Assignments inside a loop body do not survive the iteration or the loop.
  EXPECT_EQ(
      render("{% set x = 1 %}{% for i in [1, 2] %}[{{ x }}]{% set x = 7 %}{% endfor %}{{ x }}"),
      "[1][1]1");
  EXPECT_EQ(
      render(
          "{% for i in [1, 2, 3] %}{% if i == 2 %}{% set y = 5 %}{% endif %}[{{ y }}]{% endfor %}"),
      "[][5][]");
  // `if` opens no scope.
  EXPECT_EQ(render("{% if true %}{% set z = 3 %}{% endif %}{{ z }}"), "3");
  // A namespace carries state out of a loop.
  EXPECT_EQ(render("{% set ns = namespace(total=0, seen=false) %}{% for i in [1, 2, 3] %}"
                   "{% set ns.total = ns.total + i %}{% set ns.seen = true %}{% endfor %}"
                   "{{ ns.total }} {{ ns.seen }} {{ ns.missing is defined }}"),
            "6 True False");
  EXPECT_EQ(render("{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns['b'] }}{{ ns }}"),
            "12<Namespace {'a': 1, 'b': 2}>");
  EXPECT_NE(
      error_of("{% set d = {} %}{% set d.x = 1 %}").find("only a namespace() takes attribute"),
      std::string::npos);
}

TEST(Jinja, SetForms) {
  EXPECT_EQ(render("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c, d = [3, 4] %}{{ c }}{{ d }}"),
            "1234");
  EXPECT_EQ(
      render("{% set block %}Hello {{ name }}!{% endset %}[{{ block }}]", R"({"name": "Ann"})"),
      "[Hello Ann!]");
  EXPECT_EQ(render("{% set shout | upper %}quiet{% endset %}{{ shout }}"), "QUIET");
  EXPECT_EQ(render("{% filter upper %}abc {{ 'd' }}{% endfilter %}"), "ABC D");
  // A context variable can be shadowed at the top level (Llama 3.1 does this with `messages`).
  EXPECT_EQ(render("{% set messages = messages[1:] %}{{ messages | length }}",
                   R"({"messages": [1, 2, 3]})"),
            "2");
}

TEST(Jinja, Macros) {
  EXPECT_EQ(
      render(
          "{% macro greet(name, greeting='Hello', punct='!') %}{{ greeting }}, {{ name }}{{ punct "
          "}}"
          "{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', 'Hi') }} {{ greet('Cy', punct='?') }}"),
      "Hello, Ann! Hi, Bob! Hello, Cy?");
  // Defaults may use earlier parameters; missing parameters are undefined.
  EXPECT_EQ(
      render(
          "{% macro m(a, c, b=a * 2) %}{{ a }}-{{ b }}-{{ c is defined }}{% endmacro %}{{ m(3) }}"),
      "3-6-False");
  EXPECT_EQ(error_of("{% macro m(a=1, b) %}{% endmacro %}"),
            "chat template line 1: a parameter without a default follows one with a default");
  // Macros see the variables of the scope they were defined in, and recursion works.
  EXPECT_EQ(render("{% set sep = '/' %}{% macro path(parts) %}{% for p in parts %}{{ sep }}{{ p }}"
                   "{% endfor %}{% endmacro %}{{ path(['a', 'b']) }}"),
            "/a/b");
  EXPECT_EQ(
      render("{% macro count(n) %}{{ n }}{% if n > 0 %}{{ count(n - 1) }}{% endif %}{% endmacro %}"
             "{{ count(3) }}"),
      "3210");
  // The result is a string: filters apply to it.
  EXPECT_EQ(render("{% macro m() %}  x  {% endmacro %}[{{ m() | trim }}]"), "[x]");
  EXPECT_NE(error_of("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}")
                .find("takes not more than 1 argument"),
            std::string::npos);
  EXPECT_NE(
      error_of("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}").find("takes no keyword argument 'b'"),
      std::string::npos);
}

TEST(Jinja, GenerationTagRendersItsBody) {
  // transformers' {% generation %} marks assistant text for training masks; rendering keeps it.
  EXPECT_EQ(render("a{% generation %}b{{ 1 }}{% endgeneration %}c"), "ab1c");
}

TEST(Jinja, RawAndComments) {
  EXPECT_EQ(render("a{# a comment {{ x }} #}b{% raw %}{{ not rendered }}{% endraw %}c"),
            "ab{{ not rendered }}c");
  // Inside raw nothing is trimmed; after {% endraw %} trim_blocks applies again.
  EXPECT_EQ(render("{% raw %}\n{{ x }}\n{% endraw %}\nafter"), "\n{{ x }}\nafter");
}

// ---- Whitespace control -------------------------------------------------------------------------

TEST(Jinja, WhitespaceControlAsTransformersConfiguresIt) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: indentation before it goes.
  EXPECT_EQ(render("<ul>\n  {% for x in [1, 2] %}\n  <li>{{ x }}</li>\n  {% endfor %}\n</ul>\n"),
            "<ul>\n  <li>1</li>\n  <li>2</li>\n</ul>");
  // Expression tags keep their surroundings.
  EXPECT_EQ(render("  {{ 1 }}\n  {{ 2 }}\n"), "  1\n  2");
  // The minus modifiers strip all whitespace on their side, newlines included.
  EXPECT_EQ(render("a  \n  {{- 'b' -}}  \n  c"), "abc");
  EXPECT_EQ(render("a\n\n{%- if true -%}\n\n  b  \n{%- endif %}\nc"), "abc");
  EXPECT_EQ(render("a {#- comment -#} b"), "ab");
  // `+` keeps the indentation lstrip_blocks would remove.
  EXPECT_EQ(render("x\n  {%+ if true %}y{% endif %}"), "x\n  y");
  // Not at the start of a line: no lstrip.
  EXPECT_EQ(render("x  {% if true %}y{% endif %}"), "x  y");
  // A comment tag also trims its newline; one trailing newline of the template is dropped.
  EXPECT_EQ(render("{# c #}\nline\n\n"), "line\n");
  // Windows newlines read as \n.
  EXPECT_EQ(render("a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n"), "a\nb\n");
}

// ---- Filters ------------------------------------------------------------------------------------

TEST(Jinja, StringFilters) {
  EXPECT_EQ(render("{{ '  hi  ' | trim }}|{{ 'xxhixx' | trim('x') }}|{{ 'Hello' | upper }}|{{ "
                   "'Hello' | lower }}"),
            "hi|hi|HELLO|hello");
  EXPECT_EQ(render("{{ 'hELLO world' | capitalize }}|{{ 'hello wORLD-foo (bar)' | title }}"),
            "Hello world|Hello World-Foo (Bar)");
  EXPECT_EQ(render("{{ 'a-b-c' | replace('-', '+') }}|{{ 'a-b-c' | replace('-', '', 1) }}"),
            "a+b+c|ab-c");
  EXPECT_EQ(render("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|"
                   "{{ 'a\\n\\nb' | indent('> ', blank=true) }}"),
            "a\n  b\n\n  c|  a\n  b|a\n> \n> b");
  EXPECT_EQ(render("{{ '<a href=\"x\">&\\'' | e }}|{{ '<b>' | escape }}|{{ '<i>' | safe }}"),
            "&lt;a href=&#34;x&#34;&gt;&amp;&#39;|&lt;b&gt;|<i>");
  EXPECT_EQ(
      render("{{ 'héllo' | length }}|{{ 'abc' | reverse }}|{{ 'one two  three' | wordcount }}"),
      "5|cba|3");
  EXPECT_EQ(render("{{ 42 | string }}|{{ [1] | string }}|{{ none | string }}"), "42|[1]|None");
}

TEST(Jinja, NumberFilters) {
  EXPECT_EQ(render("{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ 3.9 | "
                   "int }} {{ true | int }}"),
            "42 4 0 7 3 1");
  EXPECT_EQ(
      render(
          "{{ '2.5' | float }} {{ 3 | float }} {{ 'x' | float }} {{ -3 | abs }} {{ 2.5 | round }} "
          "{{ 3.14159 | round(2) }} {{ 2.1 | round(0, 'ceil') }}"),
      "2.5 3.0 0.0 3 2.0 3.14 3.0");
}

TEST(Jinja, SequenceFilters) {
  const std::string ctx = R"({"xs": [3, 1, 2], "words": ["b", "A", "c", "a"],
      "people": [{"name": "Ann", "age": 30, "tags": {"role": "admin"}}, {"name": "Bob", "age": 25},
                 {"name": "Cy", "age": 35, "tags": {"role": "user"}}]})";
  EXPECT_EQ(render("{{ xs | first }} {{ xs | last }} {{ xs | length }} {{ xs | count }} {{ [] | "
                   "first is defined }}",
                   ctx),
            "3 2 3 3 False");
  EXPECT_EQ(render("{{ xs | sort }} {{ xs | sort(reverse=true) }} {{ words | sort }} {{ words | "
                   "sort(case_sensitive=true) }}",
                   ctx),
            "[1, 2, 3] [3, 2, 1] ['A', 'a', 'b', 'c'] ['A', 'a', 'b', 'c']");
  EXPECT_EQ(render("{{ xs | reverse | list }} {{ words | unique | list }} {{ xs | join(', ') }} {{ "
                   "xs | sum }} {{ xs | min }} {{ xs | max }}",
                   ctx),
            "[2, 1, 3] ['b', 'A', 'c'] 3, 1, 2 6 1 3");
  EXPECT_EQ(render("{{ people | map(attribute='name') | join('/') }} {{ people | "
                   "sort(attribute='age') | map(attribute='name') | list }}",
                   ctx),
            "Ann/Bob/Cy ['Bob', 'Ann', 'Cy']");
  EXPECT_EQ(render("{{ people | selectattr('age', 'gt', 26) | map(attribute='name') | list }} "
                   "{{ people | rejectattr('tags') | map(attribute='name') | list }} "
                   "{{ people | selectattr('tags.role', 'equalto', 'user') | map(attribute='name') "
                   "| first }}",
                   ctx),
            "['Ann', 'Cy'] ['Bob'] Cy");
  EXPECT_EQ(render("{{ people | map(attribute='tags.role', default='-') | list }} {{ people | "
                   "join(', ', attribute='name') }}",
                   ctx),
            "['admin', '-', 'user'] Ann, Bob, Cy");
  EXPECT_EQ(render("{{ xs | select('odd') | list }} {{ xs | reject('odd') | list }} {{ words | "
                   "map('upper') | list }} "
                   "{{ [0, 1, '', 'x'] | select | list }}",
                   ctx),
            "[3, 1] [2] ['B', 'A', 'C', 'A'] [1, 'x']");
  EXPECT_EQ(render("{{ {'b': 1, 'a': 2} | items | list }} {{ {'b': 1, 'A': 2} | dictsort }} {{ "
                   "'ab' | list }}"),
            "[('b', 1), ('a', 2)] [('A', 2), ('b', 1)] ['a', 'b']");
  EXPECT_EQ(render("{{ u | default('dflt') }} {{ none | default('dflt') }} {{ '' | d('dflt', true) "
                   "}} {{ 0 | default(5, boolean=true) }}"),
            "dflt None dflt 5");
}

TEST(Jinja, ToJsonMatchesPythonJsonDumps) {
  const std::string ctx =
      R"({"tool": {"name": "get_weather", "description": "Météo — 天気 😀 \"quoted\" \\ back\nslash\t\u0001",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "empty": {}, "list": []},
      "n": 3, "f": 0.5, "big": 1e100, "ok": true, "nothing": null}})";
  EXPECT_EQ(
      render("{{ tool | tojson }}", ctx),
      R"({"name": "get_weather", "description": "Météo — 天気 😀 \"quoted\" \\ back\nslash\t\u0001", )"
      R"("parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "empty": {}, "list": []}, )"
      R"("n": 3, "f": 0.5, "big": 1e+100, "ok": true, "nothing": null})");
  EXPECT_EQ(
      render("{{ tool.parameters | tojson(indent=2) }}", ctx),
      "{\n  \"type\": \"object\",\n  \"properties\": {\n    \"city\": {\n      \"type\": "
      "\"string\"\n"
      "    }\n  },\n  \"required\": [\n    \"city\"\n  ],\n  \"empty\": {},\n  \"list\": []\n}");
  EXPECT_EQ(
      render("{{ {'é': 'ü😀', 'b': 1, 'a': [1, 2]} | tojson(ensure_ascii=true, sort_keys=true) }}"),
      R"({"a": [1, 2], "b": 1, "\u00e9": "\u00fc\ud83d\ude00"})");
  EXPECT_EQ(render("{{ [1, {'a': 2}] | tojson(separators=(',', ':')) }}|{{ 'x' | tojson }}|{{ 2.0 "
                   "| tojson }}"),
            R"([1,{"a":2}]|"x"|2.0)");
  EXPECT_NE(error_of("{{ undefined_thing | tojson }}")
                .find("Object of type Undefined is not JSON serializable"),
            std::string::npos);
}

// ---- Tests --------------------------------------------------------------------------------------

TEST(Jinja, Tests) {
  EXPECT_EQ(render("{{ x is defined }}{{ y is undefined }}{{ none is none }}{{ 'a' is string }}"
                   "{{ {} is mapping }}{{ [] is mapping }}",
                   R"({"x": 1})"),
            "TrueTrueTrueTrueTrueFalse");
  EXPECT_EQ(
      render("{{ [] is iterable }}{{ 'a' is iterable }}{{ 1 is iterable }}{{ [] is sequence }}"
             "{{ 1 is number }}{{ 1.5 is number }}{{ true is number }}{{ 1 is integer }}{{ true is "
             "integer }}"
             "{{ 1.0 is float }}{{ true is boolean }}{{ true is true }}{{ 1 is true }}{{ false is "
             "false }}"),
      "TrueTrueFalseTrueTrueTrueTrueTrueFalseTrueTrueTrueFalseTrue");
  EXPECT_EQ(render("{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 'a' is equalto 'a' "
                   "}}{{ 2 is eq(3) }}"
                   "{{ 2 is in [1, 2] }}{{ 5 is gt 3 }}{{ 'abc' is lower }}{{ 'ABC' is upper }}"),
            "TrueTrueTrueTrueFalseTrueTrueTrueTrue");
  EXPECT_EQ(
      render("{{ x is not none }}{{ x is not string }}{{ range is callable }}", R"({"x": null})"),
      "FalseTrueTrue");
}

// ---- Methods ------------------------------------------------------------------------------------

TEST(Jinja, StringMethods) {
  EXPECT_EQ(
      render(
          "[{{ '  a b  '.strip() }}][{{ '\\n\\na\\n'.lstrip('\\n') }}][{{ 'xxaxx'.rstrip('x') }}]"),
      "[a b][a\n][xxa]");
  EXPECT_EQ(render("{{ 'a,b,,c'.split(',') }} {{ '  a  b c '.split() }} {{ 'a b c'.split(' ', 1) "
                   "}} {{ 'a b c'.rsplit(' ', 1) }}"),
            "['a', 'b', '', 'c'] ['a', 'b', 'c'] ['a', 'b c'] ['a b', 'c']");
  EXPECT_EQ(render("{{ 'x</think>y'.split('</think>')[-1] }} {{ 'abc'.startswith('ab') }} {{ "
                   "'abc'.endswith(('x', 'c')) }}"),
            "y True True");
  EXPECT_EQ(render("{{ 'hello world'.title() }} {{ 'ab'.upper() }} {{ 'AB'.lower() }} {{ "
                   "'aXb'.capitalize() }}"),
            "Hello World AB ab Axb");
  EXPECT_EQ(render("{{ 'aaa'.replace('a', 'b', 2) }} {{ 'héllo'.find('l') }} {{ 'abc'.find('z') }} "
                   "{{ 'banana'.count('an') }}"),
            "bba 2 -1 2");
  EXPECT_EQ(render("{{ '-'.join(['a', 'b']) }} {{ '{} and {name}'.format(1, name='x') }} {{ "
                   "'a\\nb'.splitlines() }}"),
            "a-b 1 and x ['a', 'b']");
  EXPECT_EQ(render("{{ '42'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }}"),
            "True True True");
  EXPECT_NE(error_of("{{ 'a'.zfill(3) }}").find("unsupported method 'str.zfill'"),
            std::string::npos);
}

TEST(Jinja, DictAndListMethods) {
  const std::string ctx = R"({"d": {"a": 1, "b": null}, "xs": [1, 2, 2]})";
  EXPECT_EQ(render("{{ d.get('a') }} {{ d.get('b') }} {{ d.get('z') }} {{ d.get('z', 5) }} {{ "
                   "d.keys() | list }} {{ d.values() | list }}",
                   ctx),
            "1 None None 5 ['a', 'b'] [1, None]");
  EXPECT_EQ(render("{{ xs.count(2) }} {{ xs.index(2) }}", ctx), "2 1");
  EXPECT_NE(error_of("{{ xs.append(3) }}", ctx).find("unsupported method 'list.append'"),
            std::string::npos);
  EXPECT_NE(error_of("{{ d.update({}) }}", ctx).find("unsupported method 'dict.update'"),
            std::string::npos);
}

TEST(Jinja, Globals) {
  EXPECT_EQ(
      render("{{ range(3) | list }} {{ range(1, 7, 2) | list }} {{ range(3, 0, -1) | list }}"),
      "[0, 1, 2] [1, 3, 5] [3, 2, 1]");
  EXPECT_EQ(render("{{ dict(a=1, b='x') }}"), "{'a': 1, 'b': 'x'}");
  EXPECT_EQ(render("{{ strftime_now('%Y') | length }}"), "4");
  EXPECT_NE(error_of("{{ range(200000) | length }}").find("MAX_RANGE"), std::string::npos);
}

// ---- Undefined ----------------------------------------------------------------------------------

TEST(Jinja, UndefinedBehavesLikeJinja2sDefault) {
  EXPECT_EQ(render("[{{ u }}][{{ u.attr }}][{{ u['k'] }}][{{ u | length }}][{{ u is defined }}][{% "
                   "if u %}t{% else %}f{% endif %}]"),
            "[][][][0][False][f]");
  EXPECT_EQ(render("{% for x in u %}x{% endfor %}|{{ u | list }}|{{ u == u }}|{{ 1 in u }}"),
            "|[]|True|False");
  EXPECT_EQ(error_of("{{ u() }}"), "chat template line 1: 'u' is undefined");
  EXPECT_EQ(error_of("\n{{ u + 1 }}"), "chat template line 2: 'u' is undefined");
  EXPECT_EQ(error_of("{{ m.f() }}", R"({"m": {}})"),
            "chat template line 1: unsupported method 'dict.f'");
}

// ---- Errors and limits --------------------------------------------------------------------------

TEST(Jinja, UnsupportedConstructsNameThemselvesAndTheLine) {
  EXPECT_EQ(error_of("line 1\nline 2\n{{ x | wordwrap }}"),
            "chat template line 3: unsupported filter 'wordwrap'");
  EXPECT_EQ(error_of("{% if x is prime %}{% endif %}"),
            "chat template line 1: unsupported test 'prime'");
  EXPECT_EQ(error_of("\n{% include 'other.jinja' %}"),
            "chat template line 2: unsupported tag 'include'");
  EXPECT_EQ(error_of("{% call m() %}{% endcall %}"),
            "chat template line 1: unsupported tag 'call'");
  EXPECT_EQ(error_of("{% frobnicate %}"), "chat template line 1: unsupported tag 'frobnicate'");
  // Unknown filters are refused even in a branch that never runs (as Jinja2 does at compile time).
  EXPECT_EQ(error_of("{% if false %}\n{{ x | nosuch }}{% endif %}"),
            "chat template line 2: unsupported filter 'nosuch'");
  EXPECT_EQ(error_of("{{ [1] | map('nosuch') | list }}"),
            "chat template line 1: unsupported filter 'nosuch'");
  EXPECT_EQ(error_of("{{ '%s' % 1 }}"),
            "chat template line 1: unsupported operator: printf-style string formatting ('%' on a "
            "string)");
}

TEST(Jinja, SyntaxErrorsNameTheLine) {
  EXPECT_EQ(error_of("a\n{% if x %}\nb"),
            "chat template line 2: unexpected end of template: the block opened here needs elif or "
            "else or endif");
  EXPECT_EQ(error_of("{% endfor %}"), "chat template line 1: unexpected tag 'endfor'");
  EXPECT_EQ(error_of("{{ 'unterminated }}"), "chat template line 1: unterminated string literal");
  EXPECT_EQ(error_of("{{ x\n"), "chat template line 1: unexpected end of template: missing '}}'");
  EXPECT_EQ(error_of("{# never closed"),
            "chat template line 1: unterminated comment: missing '#}'");
  EXPECT_EQ(error_of("{{ (1 + ) }}"), "chat template line 1: expected an expression, got ')'");
  EXPECT_EQ(error_of("{% break %}"), "chat template line 1: 'break' outside a for loop");
  EXPECT_EQ(error_of("{{ 1 < 2 < 3 }}"),
            "chat template line 1: unsupported chained comparison (write it with 'and')");
}

TEST(Jinja, RaiseException) {
  EXPECT_EQ(
      error_of("ok\n{{ raise_exception('Conversation roles must alternate') }}"),
      "chat template line 2: the template raised an error: Conversation roles must alternate");
}

TEST(Jinja, RunawayTemplatesStop) {
  JinjaLimits limits;
  limits.max_output_bytes = 1000;
  EXPECT_NE(
      error_of("{% for i in range(100) %}{{ 'xxxxxxxxxxxxxxxxxxxx' }}{% endfor %}", "{}", limits)
          .find("exceeds the output limit of 1000 bytes"),
      std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 100000 }}", "{}", limits).find("output limit"), std::string::npos);
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
                .find("macro calls nest deeper than 100"),
            std::string::npos);
  limits.max_loop_iterations = 50;
  EXPECT_NE(error_of("{% for i in range(10) %}{% for j in range(10) %}{% endfor %}{% endfor %}",
                     "{}", limits)
                .find("more than 50 loop iterations"),
            std::string::npos);
  std::string deep;
  for (int i = 0; i < 500; ++i) deep += "(";
  deep = "{{ " + deep + "1";
  for (int i = 0; i < 500; ++i) deep += ")";
  EXPECT_NE(error_of(deep + " }}").find("nests deeper than 200 levels"), std::string::npos);
  const std::string nested_json = "{\"x\": " + std::string(300, '[') + std::string(300, ']') + "}";
  EXPECT_NE(error_of("{{ x }}", nested_json).find("nests deeper than 256 levels"),
            std::string::npos);
}

TEST(Jinja, ValuesConvertToAndFromJson) {
  const ordered_json json = ordered_json::parse(
      R"({"z": 1, "a": [true, null, 2.5, "é😀", {"k": []}], "big": 18446744073709551615, "neg": -3})");
  const jinja::Value value = jinja::Value::from_json(json);
  EXPECT_EQ(value.as_object().entries.front().first, "z");  // order kept
  ordered_json expected = json;
  expected["big"] = 18446744073709551615.0;  // beyond int64: a float, as the engine sees it
  EXPECT_EQ(value.to_json(), expected);
  EXPECT_EQ(jinja::to_str(value),
            "{'z': 1, 'a': [True, None, 2.5, 'é😀', {'k': []}], 'big': 1.8446744073709552e+19, "
            "'neg': -3}");
}

TEST(Jinja, RenderNeedsAnObjectContext) {
  Result<JinjaTemplate> tpl = JinjaTemplate::parse("x");
  ASSERT_TRUE(tpl.ok());
  const Result<std::string> out = tpl->render(ordered_json::array());
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.message().find("must be a JSON object"), std::string::npos);
}

// ---- Which output came from untrusted strings
// ----------------------------------------------------

// The text with each untrusted range in brackets: "<s>[hi]</s>".
std::string tracked(const std::string& source, const std::string& untrusted_json,
                    const std::string& trusted_json = "{}") {
  Result<JinjaTemplate> tpl = JinjaTemplate::parse(source);
  EXPECT_TRUE(tpl.ok()) << tpl.message();
  if (!tpl.ok()) return "<error>";
  const Result<jinja::TrackedText> out =
      tpl->render_tracked(ordered_json::parse(trusted_json), ordered_json::parse(untrusted_json));
  EXPECT_TRUE(out.ok()) << "template: " << source << "\nerror: " << out.message();
  if (!out.ok()) return "<error>";
  std::string shown;
  size_t at = 0;
  for (const auto& [begin, end] : out->untrusted) {
    // Sorted, disjoint, not touching and not empty.
    EXPECT_TRUE(at == 0 ? begin >= at : begin > at) << source;
    EXPECT_LT(begin, end) << source;
    EXPECT_LE(end, out->text.size()) << source;
    shown += out->text.substr(at, begin - at) + "[" + out->text.substr(begin, end - begin) + "]";
    at = end;
  }
  return shown + out->text.substr(at);
}

TEST(JinjaTracking, TemplateTextIsTrustedAndContextStringsAreNot) {
  EXPECT_EQ(tracked("<s>{{ u }}</s>{{ t }}", R"({"u": "hi"})", R"({"t": "<eos>"})"),
            "<s>[hi]</s><eos>");
  // Numbers and booleans of the context cannot spell a token; they print as trusted text.
  EXPECT_EQ(tracked("{{ n }}{{ b }}", R"({"n": 12, "b": true})"), "12True");
  // A list or dict printed whole is untrusted if anything in it is.
  EXPECT_EQ(tracked("{{ m }}|{{ [1, 2] }}", R"({"m": {"k": 1}})"), "[{'k': 1}]|[1, 2]");
  EXPECT_EQ(tracked("{{ m|tojson }}", R"({"m": [1, "a"]})"), "[[1, \"a\"]]");
}

TEST(JinjaTracking, ConcatenationSlicingAndStripKeepTheRanges) {
  const std::string ctx = R"({"u": "  ab  ", "v": "xyz", "m": [{"content": "q"}]})";
  EXPECT_EQ(tracked("{{ '<' + v + '>' }}", ctx), "<[xyz]>");
  EXPECT_EQ(tracked("{{ '<' ~ v ~ 1 ~ '>' }}", ctx), "<[xyz]1>");
  EXPECT_EQ(tracked("{{ ('<' + v)[0:3] }}|{{ v[1] }}|{{ v[::-1] }}", ctx), "<[xy]|[y]|[zyx]");
  EXPECT_EQ(tracked("{{ ('[' + u + ']')|trim('[]') }}|{{ (' <' + u).strip() }}", ctx),
            "[  ab  ]|<[  ab]");
  EXPECT_EQ(tracked("{{ ('<' + v).removeprefix('<') }}|{{ (v + '>').removesuffix('y>') }}", ctx),
            "[xyz]|[xyz]>");
  EXPECT_EQ(tracked("{{ ('<' + v) * 2 }}", ctx), "<[xyz]<[xyz]");
  EXPECT_EQ(tracked("{{ '|'.join([v, 'k', v]) }}|{{ [v, 'k']|join('-') }}", ctx),
            "[xyz]|k|[xyz]|[xyz]-k");
  EXPECT_EQ(tracked("{% for c in '<' + v %}{{ c }}.{% endfor %}", ctx), "<.[x].[y].[z].");
  // Through set blocks, namespaces and macros.
  EXPECT_EQ(tracked("{% set s %}<{{ v }}>{% endset %}{{ s }}", ctx), "<[xyz]>");
  EXPECT_EQ(tracked("{% set ns = namespace(t='') %}{% for x in m %}{% set ns.t = ns.t + '<' + "
                    "x.content %}{% endfor %}{{ ns.t }}",
                    ctx),
            "<[q]");
  EXPECT_EQ(tracked("{% macro w(x) %}<{{ x }}>{% endmacro %}{{ w(v) }}{{ w('k') }}", ctx),
            "<[xyz]><k>");
}

TEST(JinjaTracking, OtherBuiltinsMakeTheirResultUntrustedAsAWhole) {
  const std::string ctx = R"({"v": "a<b", "d": {"key<": "x"}})";
  // replace, upper, format, split: whatever they compute from an untrusted string is untrusted,
  // even the parts that came from trusted arguments.
  EXPECT_EQ(tracked("{{ v|replace('<', '<|x|>') }}", ctx), "[a<|x|>b]");
  EXPECT_EQ(tracked("{{ ('<' + v)|upper }}", ctx), "[<A<B]");
  EXPECT_EQ(tracked("{{ '<{}>'.format(v) }}", ctx), "[<a<b>]");
  EXPECT_EQ(tracked("{{ v.split('<')[1] }}", ctx), "[b]");
  // ... and from trusted input only, trusted.
  EXPECT_EQ(tracked("{{ 'a<b'|replace('<', '>') }}|{{ '<{}>'.format('k') }}", ctx), "a>b|<k>");
  // Dict keys from the context are untrusted wherever they go.
  EXPECT_EQ(tracked("{% for k in d %}{{ k }}{% endfor %}|{% for k, x in d.items() %}{{ k }}="
                    "{{ x }}{% endfor %}|{{ d|tojson }}",
                    ctx),
            "[key<]|[key<]=[x]|[{\"key<\": \"x\"}]");
  // A dict built in the template with an untrusted key.
  EXPECT_EQ(tracked("{% for k in {v: 1} %}{{ k }}{% endfor %}", ctx), "[a<b]");
}

TEST(JinjaTracking, RenderKeepsTheSameText) {
  // render() is render_tracked() with every variable trusted: the same text.
  const std::string source = "{% for m in ms %}<{{ m.r }}>{{ m.c|trim }}{% endfor %}";
  const std::string ctx = R"({"ms": [{"r": "u", "c": " hi "}, {"r": "a", "c": "yo"}]})";
  EXPECT_EQ(render(source, ctx), "<u>hi<a>yo");
  EXPECT_EQ(tracked(source, ctx), "<[u]>[hi]<[a]>[yo]");
  Result<JinjaTemplate> tpl = JinjaTemplate::parse("{{ x }}");
  ASSERT_TRUE(tpl.ok());
  const Result<jinja::TrackedText> twice =
      tpl->render_tracked(ordered_json::parse(R"({"x": 1})"), ordered_json::parse(R"({"x": 2})"));
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.message().find("\"x\" is given twice"), std::string::npos) << twice.message();
}

}  // namespace
}  // namespace e4kv
