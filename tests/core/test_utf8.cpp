// core/utf8: the offset of the first invalid sequence, on hand-built cases covering every class of
// invalid UTF-8 the standard names.
#include "core/utf8.h"

#include <gtest/gtest.h>

#include <string>

namespace e4kv {
namespace {

TEST(Utf8, FirstInvalidOffset) {
  struct Case {
    std::string text;
    std::optional<size_t> offset;
  };
  const Case cases[] = {
      {"", std::nullopt},
      {"plain ascii", std::nullopt},
      {"caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80", std::nullopt},  // é € 😀
      {"\xFF", 0},                                                      // never valid
      {"ab\x80", 2},                                                    // lone continuation
      {"ab\xC0\x80", 2},                                                // overlong NUL
      {"x\xE0\x80\xAF", 1},                                             // overlong 3-byte
      {"xy\xED\xA0\x80", 2},                                            // UTF-16 surrogate
      {"\xF4\x90\x80\x80", 0},                                          // above U+10FFFF
      {"ok\xE2\x82", 2},                                                // truncated at the end
      {"\xC3\xA9\xC3", 2},                                              // truncated after a char
      {"\xC3\xA9 \xC3(", 3},                                            // bad continuation
  };
  for (const Case& c : cases) {
    EXPECT_EQ(first_invalid_utf8(c.text), c.offset) << testing::PrintToString(c.text);
    EXPECT_EQ(is_valid_utf8(c.text), !c.offset.has_value());
  }
}

TEST(Utf8, LossyRepairReplacesEachMaximalSubpart) {
  // "\xE2\x82" is one maximal subpart (a truncated euro sign): one U+FFFD; "\xFF" another.
  EXPECT_EQ(to_valid_utf8("a\xE2\x82" "b\xFF"), "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
  std::string out;
  // Not final: the incomplete sequence at the end waits for more bytes.
  EXPECT_EQ(append_lossy_utf8("a\xE2\x82", false, out), 1u);
  EXPECT_EQ(out, "a");
}

TEST(Utf8, EncodeDecodeRoundTrip) {
  for (char32_t cp : {char32_t{0x41}, char32_t{0xE9}, char32_t{0x20AC}, char32_t{0x1F600},
                      char32_t{0x10FFFF}}) {
    std::string text;
    append_utf8(text, cp);
    ASSERT_TRUE(is_valid_utf8(text));
    const Utf8Step step = utf8_step(text, 0);
    EXPECT_EQ(step.length, text.size());
    EXPECT_EQ(utf8_decode(text, 0, step.length), cp);
  }
}

}  // namespace
}  // namespace e4kv
