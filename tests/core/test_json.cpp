#include "core/json.h"

#include <algorithm>
#include <chrono>
#include <string>

#include <gtest/gtest.h>

namespace e4kv {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// `levels` arrays inside one another: "[[[...]]]".
std::string nested_arrays(int levels) {
  return std::string(size_t(levels), '[') + std::string(size_t(levels), ']');
}

// The deepest nesting of arrays and objects in `value` (at most kMaxJsonDepth here, so recursing
// is safe).
int depth_of(const json& value) {
  if (!value.is_structured()) return 0;
  int deepest = 0;
  for (const auto& item : value) deepest = std::max(deepest, depth_of(item));
  return deepest + 1;
}

bool has(const Status& status, const std::string& needle) {
  return status.message().find(needle) != std::string::npos;
}

TEST(JsonParse, ParsesPlainValues) {
  Result<json> value = parse_json(R"({"a": [1, 2.5, "x", null, true], "b": {}})", "f.json");
  ASSERT_TRUE(value.ok()) << value.message();
  EXPECT_EQ(*value, json({{"a", {1, 2.5, "x", nullptr, true}}, {"b", json::object()}}));
  Result<json> scalar = parse_json("7", "f.json");
  ASSERT_TRUE(scalar.ok()) << scalar.message();
  EXPECT_EQ(*scalar, json(7));
}

TEST(JsonParse, OrderedKeepsKeyOrder) {
  Result<ordered_json> value = parse_ordered_json(R"({"z": 1, "a": 2, "m": 3})", "f.json");
  ASSERT_TRUE(value.ok()) << value.message();
  std::string keys;
  for (const auto& [key, item] : value->items()) keys += key;
  EXPECT_EQ(keys, "zam");
}

TEST(JsonParse, DepthExactlyAtTheLimitIsAccepted) {
  Result<json> value = parse_json(nested_arrays(kMaxJsonDepth), "f.json");
  ASSERT_TRUE(value.ok()) << value.message();
  EXPECT_EQ(depth_of(*value), kMaxJsonDepth);
  // A scalar at the bottom adds no level.
  const std::string with_scalar =
      std::string(kMaxJsonDepth, '[') + "1" + std::string(kMaxJsonDepth, ']');
  EXPECT_TRUE(parse_json(with_scalar, "f.json").ok());
  EXPECT_TRUE(parse_ordered_json(nested_arrays(kMaxJsonDepth), "f.json").ok());
}

TEST(JsonParse, OneLevelMoreIsRefused) {
  Result<json> value = parse_json(nested_arrays(kMaxJsonDepth + 1), "dir/f.json");
  ASSERT_FALSE(value.ok());
  EXPECT_EQ(value.message().rfind("dir/f.json: JSON nests deeper than 256 levels", 0), 0u)
      << value.message();
  EXPECT_FALSE(parse_ordered_json(nested_arrays(kMaxJsonDepth + 1), "f.json").ok());
}

TEST(JsonParse, CustomLimit) {
  EXPECT_TRUE(parse_json(nested_arrays(3), "f", JsonLimits{.max_depth = 3}).ok());
  Result<json> deep = parse_json(nested_arrays(4), "f", JsonLimits{.max_depth = 3});
  ASSERT_FALSE(deep.ok());
  EXPECT_TRUE(has(deep.status(), "f: JSON nests deeper than 3 levels")) << deep.message();
  // A lone scalar nests 0 levels; a limit of 0 refuses every array or object.
  EXPECT_TRUE(parse_json("\"x\"", "f", JsonLimits{.max_depth = 0}).ok());
  EXPECT_FALSE(parse_json("{}", "f", JsonLimits{.max_depth = 0}).ok());
}

TEST(JsonParse, HundredThousandLevelsAreRefusedQuicklyWithoutACrash) {
  for (const bool ordered : {false, true}) {
    const std::string text = nested_arrays(100'000);
    const auto start = std::chrono::steady_clock::now();
    const Status status = ordered ? parse_ordered_json(text, "deep.json").status()
                                  : parse_json(text, "deep.json").status();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(has(status, "deep.json: JSON nests deeper than 256 levels")) << status.message();
    // Refused after reading 257 brackets; a generous bound that a full parse of the rest would
    // still meet, but far from a hang.
    EXPECT_LT(seconds, 1.0);
    EXPECT_LT(status.message().size(), 200u);
  }
  // An unclosed deep array is refused the same way, not as a truncated input.
  EXPECT_TRUE(has(parse_json(std::string(100'000, '['), "deep.json").status(), "256 levels"));
}

TEST(JsonParse, BracketsInsideStringsAreNotCounted) {
  const std::string many(1000, '[');
  Result<json> value = parse_json("{\"s\": \"" + many + "]]]{{{\", \"t\": [\"[[[\"]}", "f.json");
  ASSERT_TRUE(value.ok()) << value.message();
  EXPECT_EQ((*value)["s"].get<std::string>(), many + "]]]{{{");
  // An escaped quote does not end the string early.
  Result<json> escaped = parse_json("[\"\\\"" + many + "\"]", "f.json");
  ASSERT_TRUE(escaped.ok()) << escaped.message();
  EXPECT_EQ((*escaped)[0].get<std::string>(), "\"" + many);
}

TEST(JsonParse, ObjectsAndArraysMixedCountAlike) {
  // {"a": [{"a": [...]}]}: every object and every array is a level.
  auto mixed = [](int levels) {
    std::string open, close;
    for (int i = 0; i < levels; ++i) {
      open += i % 2 == 0 ? "{\"a\": " : "[";
      close = (i % 2 == 0 ? "}" : "]") + close;
    }
    return open + "0" + close;
  };
  Result<json> at_limit = parse_json(mixed(kMaxJsonDepth), "f.json");
  ASSERT_TRUE(at_limit.ok()) << at_limit.message();
  EXPECT_EQ(depth_of(*at_limit), kMaxJsonDepth);
  EXPECT_TRUE(has(parse_json(mixed(kMaxJsonDepth + 1), "f.json").status(), "256 levels"));
  EXPECT_TRUE(has(parse_ordered_json(mixed(kMaxJsonDepth + 1), "f.json").status(), "256 levels"));
}

TEST(JsonParse, SyntaxErrorsNameTheSourceAndByteWithoutEchoingTheInput) {
  Result<json> bad = parse_json("{\"a\": 1,\n \"secret-value\" x}", "c.jsonl:3");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.message().rfind("c.jsonl:3: invalid JSON at byte 26: ", 0), 0u) << bad.message();
  EXPECT_FALSE(has(bad.status(), "secret-value")) << bad.message();
  EXPECT_EQ(bad.message().find('\n'), std::string::npos) << bad.message();
  // Errors the parser raises as something other than a parse error.
  Result<json> overflow = parse_json("[1e400]", "f.json");
  ASSERT_FALSE(overflow.ok());
  EXPECT_TRUE(has(overflow.status(), "f.json: invalid JSON: number overflow"))
      << overflow.message();
  EXPECT_TRUE(has(parse_json("", "f.json").status(), "f.json: invalid JSON at byte 1"));
}

TEST(JsonParse, EventCheckCanRefuse) {
  int keys = 0;
  auto no_key_b = [&](int depth, json::parse_event_t event, const json& parsed) -> Status {
    if (event != json::parse_event_t::key) return ok_status();
    ++keys;
    if (parsed == "b") return Status::error(cat("f.json: key b at depth ", depth));
    return ok_status();
  };
  Result<json> value = parse_json(R"({"a": {"b": 1}, "c": 2})", "f.json", {}, no_key_b);
  ASSERT_FALSE(value.ok());
  EXPECT_EQ(value.message(), "f.json: key b at depth 2");
  EXPECT_EQ(keys, 2);  // stopped at "b"
  EXPECT_TRUE(parse_json(R"({"a": 1})", "f.json", {}, no_key_b).ok());
}

TEST(JsonExcerpt, SmallValuesReadAsDump) {
  for (const char* text : {"1", "-2.5", "null", "true", "\"x\"", "[1,2]", R"({"a":[1,{"b":null}]})",
                           "[]", "{}", R"("tab\tquote\"")"}) {
    const json value = json::parse(text);
    EXPECT_EQ(json_excerpt(value, 100), value.dump()) << text;
    EXPECT_EQ(json_excerpt(ordered_json::parse(text), 100), ordered_json::parse(text).dump());
  }
}

TEST(JsonExcerpt, DeepValueIsBoundedAndShallow) {
  Result<json> deep = parse_json(nested_arrays(kMaxJsonDepth), "f.json");
  ASSERT_TRUE(deep.ok());
  const std::string text = json_excerpt(*deep, 48);
  EXPECT_EQ(text, "[[[[...]]]]");
  // Objects the same way.
  EXPECT_EQ(json_excerpt(json::parse(R"({"a":{"b":{"c":{"d":{}}}}})"), 48),
            R"({"a":{"b":{"c":{...}}}})");
}

TEST(JsonExcerpt, HugeValueIsCut) {
  json big = json::array();
  for (int i = 0; i < 100'000; ++i) big.push_back(i);
  const std::string text = json_excerpt(big, 48);
  EXPECT_EQ(text.size(), 48u) << text;
  EXPECT_EQ(text, big.dump().substr(0, 45) + "...");

  const json long_string = std::string(1'000'000, 'x');
  const std::string cut = json_excerpt(long_string, 20);
  EXPECT_EQ(cut, "\"xxxxxxxxxxxxxxxx...");
  EXPECT_LE(json_excerpt(long_string, 300).size(), 300u);

  json wide = json::object();
  for (int i = 0; i < 1000; ++i) wide[cat("key", i)] = std::string(1000, 'y');
  EXPECT_LE(json_excerpt(wide, 80).size(), 80u);
  EXPECT_EQ(json_excerpt(wide, 80).substr(0, 10), "{\"key0\":\"y");
}

TEST(JsonExcerpt, CutsWholeUtf8Characters) {
  // "é" is two bytes; no cut may leave half of one.
  std::string accents;
  for (int i = 0; i < 100; ++i) accents += "\xc3\xa9";
  const json text = accents;
  for (size_t max = 4; max < 40; ++max) {
    const std::string cut = json_excerpt(text, max);
    EXPECT_LE(cut.size(), max);
    EXPECT_NO_THROW((void)json(cut).dump()) << max;  // strict UTF-8 check of the result
  }
}

}  // namespace
}  // namespace e4kv
