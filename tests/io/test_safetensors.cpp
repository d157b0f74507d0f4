// safetensors reader and writer: round trips through the writer, files built byte by byte (so the
// reader is not only checked against our own writer), and one test per malformed-input rule, each
// asserting the error names the file and says what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;

const std::vector<DType> kAllDTypes = {
    DType::kF64,    DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3,
    DType::kF8E5M2, DType::kI64, DType::kI32, DType::kI16,  DType::kI8,
    DType::kU64,    DType::kU32, DType::kU16, DType::kU8,   DType::kBool,
};

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng() & 0xFF);
  return out;
}

// 8-byte little-endian length, then `header` verbatim, then `data`: a file image built without the
// writer. `length` overrides the length field when set.
std::vector<std::byte> make_image(const std::string& header, const std::string& data = "",
                                  std::optional<uint64_t> length = std::nullopt) {
  const uint64_t n = length.value_or(header.size());
  std::vector<std::byte> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>((n >> (8 * i)) & 0xFF));
  for (char c : header) out.push_back(static_cast<std::byte>(c));
  for (char c : data) out.push_back(static_cast<std::byte>(c));
  return out;
}

std::string read_file_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file_bytes(const fs::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::string> directory_entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           cat("e4kv_safetensors_", ::getpid(), "_", info->test_suite_name(), "_", info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
};

// ---- round trips -------------------------------------------------------------------------------

TEST_F(SafetensorsTest, RoundTripEveryDTypeScalarsEmptyAndMetadata) {
  struct Source {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> data;
  };
  std::vector<Source> sources;
  uint32_t seed = 1;
  for (DType dtype : kAllDTypes) {
    const std::string base(dtype_name(dtype));
    sources.push_back(
        {"matrix." + base, dtype, {2, 3}, random_bytes(6 * dtype_size(dtype), seed++)});
    sources.push_back({"scalar." + base, dtype, {}, random_bytes(dtype_size(dtype), seed++)});
    sources.push_back({"empty." + base, dtype, {0, 5}, {}});
  }
  // A non-ASCII name, to check UTF-8 names survive.
  sources.push_back({"layers.\xc3\xa9t\xc3\xa9.w", DType::kF32, {1}, random_bytes(4, seed++)});

  std::vector<SafetensorsWriteTensor> tensors;
  for (const Source& s : sources) tensors.push_back({s.name, s.dtype, s.shape, s.data});
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"note", "quotes \" and \\ and \xe2\x9c\x93"}, {"empty", ""}};
  const fs::path path = dir_ / "model.safetensors";
  const Status written = write_safetensors(path, tensors, metadata);
  ASSERT_TRUE(written.ok()) << written.message();

  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_EQ(file->source(), path.string());
  EXPECT_EQ(file->metadata(), metadata);
  EXPECT_EQ(file->header_bytes() % 8, 0u);
  ASSERT_EQ(file->tensors().size(), sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    const Source& s = sources[i];
    SCOPED_TRACE(s.name);
    const SafetensorsTensor* t = file->find(s.name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->name, s.name);
    EXPECT_EQ(t->dtype, s.dtype);
    EXPECT_EQ(t->shape, s.shape);
    int64_t numel = 1;
    for (int64_t dim : s.shape) numel *= dim;
    EXPECT_EQ(t->numel(), numel);
    EXPECT_EQ(t->end - t->begin, s.data.size());
    ASSERT_EQ(t->bytes.size(), s.data.size());
    EXPECT_TRUE(std::equal(t->bytes.begin(), t->bytes.end(), s.data.begin()));
  }
  // The writer packs tensors in the given order, so data-section order is the given order (ties
  // between zero-byte tensors at one offset are broken by name).
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : file->tensors()) {
    EXPECT_EQ(t.begin, offset) << t.name;
    offset = t.end;
  }
  EXPECT_EQ(file->find("absent"), nullptr);
}

TEST_F(SafetensorsTest, RoundTripNoTensorsNoMetadata) {
  const fs::path path = dir_ / "empty.safetensors";
  ASSERT_TRUE(write_safetensors(path, {}).ok());
  // {} padded to 8 bytes.
  EXPECT_EQ(read_file_text(path), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_TRUE(file->tensors().empty());
  EXPECT_TRUE(file->metadata().empty());
}

TEST_F(SafetensorsTest, WriterProducesTheDocumentedLayout) {
  const std::vector<std::byte> a = random_bytes(8, 7);
  const std::vector<std::byte> b = random_bytes(2, 8);
  const std::vector<SafetensorsWriteTensor> tensors = {{"b", DType::kF32, {2}, a},
                                                       {"a", DType::kU8, {2, 1}, b}};
  const fs::path path = dir_ / "layout.safetensors";
  ASSERT_TRUE(write_safetensors(path, tensors, {{"k", "v"}}).ok());
  const std::string text = read_file_text(path);
  const std::string json =
      R"({"__metadata__":{"k":"v"},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("a":{"dtype":"U8","shape":[2,1],"data_offsets":[8,10]}})";
  const size_t padded = (json.size() + 7) / 8 * 8;
  ASSERT_EQ(text.size(), 8 + padded + 10);
  EXPECT_EQ(static_cast<size_t>(static_cast<unsigned char>(text[0])), padded);
  EXPECT_EQ(text.substr(1, 7), std::string(7, '\0'));
  EXPECT_EQ(text.substr(8, padded), json + std::string(padded - json.size(), ' '));
  EXPECT_EQ(0, std::memcmp(text.data() + 8 + padded, a.data(), 8));
  EXPECT_EQ(0, std::memcmp(text.data() + 8 + padded + 8, b.data(), 2));
}

// ---- views -------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, ParseViewsPointIntoTheBuffer) {
  const std::string header =
      R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[4,8]},)"
      R"("v":{"dtype":"I8","shape":[4],"data_offsets":[0,4]},"z":{"dtype":"F32","shape":[0],)"
      R"("data_offsets":[8,8]}}   )";
  const std::vector<std::byte> image = make_image(header, "ABCDEFGH");
  Result<SafetensorsFile> file = SafetensorsFile::parse(image, "buffer");
  ASSERT_TRUE(file.ok()) << file.message();
  const std::byte* data = image.data() + 8 + header.size();
  EXPECT_EQ(file->header_bytes(), header.size());
  ASSERT_EQ(file->tensors().size(), 3u);
  // Data-section order, not name order.
  EXPECT_EQ(file->tensors()[0].name, "v");
  EXPECT_EQ(file->tensors()[1].name, "w");
  EXPECT_EQ(file->tensors()[2].name, "z");
  EXPECT_EQ(file->find("v")->bytes.data(), data);
  EXPECT_EQ(file->find("w")->bytes.data(), data + 4);
  EXPECT_EQ(file->find("w")->bytes.size(), 4u);
  EXPECT_EQ(file->find("z")->bytes.data(), data + 8);
  EXPECT_TRUE(file->find("z")->bytes.empty());
  EXPECT_EQ(file->find("z")->numel(), 0);
}

TEST_F(SafetensorsTest, OpenViewsAreZeroCopyAndByteExact) {
  const std::vector<std::byte> x = random_bytes(64 * 4, 11);
  const std::vector<std::byte> y = random_bytes(3 * 2, 12);
  const fs::path path = dir_ / "views.safetensors";
  ASSERT_TRUE(
      write_safetensors(path, std::vector<SafetensorsWriteTensor>{{"x", DType::kF32, {8, 8}, x},
                                                                  {"y", DType::kBF16, {3}, y}})
          .ok());
  const std::string on_disk = read_file_text(path);
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.message();
  const uint64_t data_start = 8 + file->header_bytes();
  const std::byte* x_view = file->find("x")->bytes.data();
  // Every view sits at its offset from one base, i.e. inside a single image of the file, and its
  // bytes are the file's bytes at that place.
  for (const SafetensorsTensor& t : file->tensors()) {
    EXPECT_EQ(t.bytes.data(), x_view + t.begin) << t.name;
    EXPECT_EQ(0, std::memcmp(t.bytes.data(), on_disk.data() + data_start + t.begin, t.bytes.size()))
        << t.name;
  }
  // Moving the file object keeps the views valid (the mapping does not move).
  SafetensorsFile moved = std::move(file).value();
  EXPECT_EQ(moved.find("x")->bytes.data(), x_view);
  EXPECT_EQ(0, std::memcmp(moved.find("y")->bytes.data(), y.data(), y.size()));
  // Not a copy of the writer's buffer.
  EXPECT_NE(x_view, x.data());
}

// ---- files built by hand -----------------------------------------------------------------------

TEST_F(SafetensorsTest, ReadsAHandBuiltFile) {
  // Two little-endian F32 values 1.0 and -2.0, then a BOOL scalar; header padded with spaces and
  // keys in an order no writer of ours would pick.
  const std::string header = R"({"flag":{"data_offsets":[8,9],"shape":[],"dtype":"BOOL"},)"
                             R"( "__metadata__" : {"format":"pt"},)"
                             "\n"
                             R"("vec":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}      )";
  const std::string data("\x00\x00\x80\x3f\x00\x00\x00\xc0\x01", 9);
  const fs::path path = dir_ / "hand.safetensors";
  write_file_bytes(path, make_image(header, data));
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  const SafetensorsTensor* vec = file->find("vec");
  ASSERT_NE(vec, nullptr);
  EXPECT_EQ(vec->dtype, DType::kF32);
  float values[2];
  std::memcpy(values, vec->bytes.data(), sizeof(values));
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], -2.0f);
  const SafetensorsTensor* flag = file->find("flag");
  ASSERT_NE(flag, nullptr);
  EXPECT_TRUE(flag->shape.empty());
  EXPECT_EQ(flag->numel(), 1);
  EXPECT_EQ(std::to_integer<int>(flag->bytes[0]), 1);
}

TEST_F(SafetensorsTest, AcceptsZeroByteTensorsBesideOthers) {
  // Zero-byte tensors at the start, between two tensors and at the end of the data section.
  const std::string header = R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)"
                             R"("b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                             R"("c":{"dtype":"U8","shape":[3,0],"data_offsets":[2,2]},)"
                             R"("d":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},)"
                             R"("e":{"dtype":"U8","shape":[0],"data_offsets":[3,3]}})";
  Result<SafetensorsFile> file = SafetensorsFile::parse(make_image(header, "xyz"), "zeros");
  ASSERT_TRUE(file.ok()) << file.message();
  std::vector<std::string> order;
  for (const auto& t : file->tensors()) order.push_back(t.name);
  EXPECT_EQ(order, (std::vector<std::string>{"a", "b", "c", "d", "e"}));
}

TEST_F(SafetensorsTest, IgnoresUnknownFieldsInAnEntry) {
  // The official reader ignores fields it does not know; so do we (they cannot move any bytes).
  const std::string header =
      R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":{"nested":[1,2]}}})";
  Result<SafetensorsFile> file = SafetensorsFile::parse(make_image(header, "xy"), "extra");
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_EQ(file->find("w")->bytes.size(), 2u);
}

TEST_F(SafetensorsTest, OpenReportsAMissingFile) {
  Result<SafetensorsFile> file = SafetensorsFile::open(dir_ / "nope.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_NE(file.message().find("nope.safetensors"), std::string::npos) << file.message();
}

TEST_F(SafetensorsTest, OpenNamesThePathInErrors) {
  const fs::path path = dir_ / "model-00001-of-00002.safetensors";
  write_file_bytes(path, make_image(R"({"model.embed_tokens.weight":{"dtype":"F32",)"
                                    R"("shape":[10,4],"data_offsets":[0,100]}})",
                                    std::string(100, 'x')));
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.message(), path.string() +
                                ": tensor 'model.embed_tokens.weight': data_offsets [0, 100] hold "
                                "100 bytes but shape [10, 4] x F32 needs 160");
}

// ---- malformed input: one case per rule --------------------------------------------------------

struct MalformedCase {
  const char* test_name;
  std::vector<std::byte> image;
  const char* phrase;  // must appear in the message
};

std::string one_tensor(const std::string& fields) {
  return R"({"w":{)" + fields + "}}";
}

std::vector<MalformedCase> malformed_cases() {
  const std::string good = R"("dtype":"F32","shape":[2],"data_offsets":[0,8])";
  const std::string eight(8, 'd');
  std::vector<MalformedCase> cases = {
      {"ShorterThanEightBytes", {std::byte{1}, std::byte{0}, std::byte{0}}, "too short"},
      {"EmptyFile", {}, "too short"},
      {"HeaderLengthBeyondFile", make_image("{}", "", 100), "past the end of the file"},
      {"HeaderLengthOver100MB", make_image("{}", "", 100'000'001), "exceeds the limit"},
      {"HeaderLengthHuge", make_image("{}", "", ~uint64_t{0}), "exceeds the limit"},
      {"InvalidJson", make_image(R"({"w": {"dtype": "F32",})"), "header: invalid JSON"},
      {"TrailingGarbageAfterJson", make_image(R"({} x)"), "header: invalid JSON"},
      {"HeaderIsAnArray", make_image("[]"), "not a JSON object"},
      {"HeaderIsEmpty", make_image(""), "not a JSON object"},
      {"EntryNotAnObject", make_image(R"({"w":[1]})"), "expected an object"},
      {"UnknownDType",
       make_image(one_tensor(R"("dtype":"F12","shape":[2],"data_offsets":[0,8])"), eight),
       "unknown dtype 'F12'"},
      {"LowercaseDType",
       make_image(one_tensor(R"("dtype":"f32","shape":[2],"data_offsets":[0,8])"), eight),
       "unknown dtype 'f32'"},
      {"DTypeNotAString",
       make_image(one_tensor(R"("dtype":4,"shape":[2],"data_offsets":[0,8])"), eight),
       "dtype is a JSON number"},
      {"ShapeTimesDTypeNotRange",
       make_image(one_tensor(R"("dtype":"F32","shape":[3],"data_offsets":[0,8])"), eight),
       "data_offsets [0, 8] hold 8 bytes but shape [3] x F32 needs 12"},
      {"RangeOutsideData",
       make_image(one_tensor(R"("dtype":"F32","shape":[2],"data_offsets":[0,8])"), "dddd"),
       "outside the data section"},
      {"OverlappingRanges",
       make_image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                  "dddddd"),
       "overlap tensor 'a'"},
      {"IdenticalRanges",
       make_image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                  "dddd"),
       "overlap"},
      {"BeginAfterEnd",
       make_image(one_tensor(R"("dtype":"F32","shape":[0],"data_offsets":[8,4])"), eight),
       "begin after end"},
      {"GapBetweenRanges",
       make_image(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                  R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                  "dddddd"),
       "bytes [2, 4) belong to no tensor"},
      {"GapAtStart",
       make_image(one_tensor(R"("dtype":"U8","shape":[2],"data_offsets":[2,4])"), "dddd"),
       "bytes [0, 2) belong to no tensor"},
      {"TrailingBytes", make_image(one_tensor(good), eight + "tt"), "2 trailing bytes"},
      {"TrailingBytesWithoutTensors", make_image("{}", "t"), "1 trailing byte after"},
      {"DuplicateNames",
       make_image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                  "dd"),
       "duplicate tensor name 'w'"},
      {"DuplicateField",
       make_image(one_tensor(R"("dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1])"),
                  "d"),
       "tensor 'w': duplicate key 'dtype'"},
      {"DuplicateMetadata", make_image(R"({"__metadata__":{},"__metadata__":{}})"),
       "more than one \"__metadata__\""},
      {"NonUtf8Name",
       make_image("{\"w\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "d"),
       "not valid UTF-8"},
      {"OverlongUtf8Name",
       make_image("{\"\xc0\xaf\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "d"),
       "not valid UTF-8"},
      {"SurrogateUtf8Name",
       make_image("{\"\xed\xa0\x80\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
                  "d"),
       "not valid UTF-8"},
      {"LoneSurrogateEscapeName",
       make_image(R"({"\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "d"),
       "header: invalid JSON"},
      {"EmptyName", make_image(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "d"),
       "tensor name is empty"},
      {"NegativeShape",
       make_image(one_tensor(R"("dtype":"U8","shape":[2,-1],"data_offsets":[0,0])")),
       "shape entry 1 is negative"},
      {"FractionalShape",
       make_image(one_tensor(R"("dtype":"U8","shape":[2.0],"data_offsets":[0,2])"), "dd"),
       "shape entry 0 (2.0) is not an integer"},
      {"ShapeNotAnArray",
       make_image(one_tensor(R"("dtype":"U8","shape":2,"data_offsets":[0,2])"), "dd"),
       "shape is a JSON number"},
      {"ShapeOverflow",
       make_image(
           one_tensor(R"("dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0])")),
       "overflows"},
      {"ByteCountOverflow",
       make_image(
           one_tensor(R"("dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0])")),
       "overflows"},
      {"ShapeBeyondInt64",
       make_image(
           one_tensor(R"("dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0])")),
       "too large"},
      {"OffsetsWrongLength",
       make_image(one_tensor(R"("dtype":"U8","shape":[1],"data_offsets":[0,1,2])"), "d"),
       "not an array of two non-negative integers"},
      {"NegativeOffset",
       make_image(one_tensor(R"("dtype":"U8","shape":[1],"data_offsets":[-1,0])"), "d"),
       "not an array of two non-negative integers"},
      {"MetadataNotAnObject", make_image(R"({"__metadata__":["a"]})"),
       "__metadata__ is a JSON array"},
      {"MetadataValueNotString", make_image(R"({"__metadata__":{"epoch":3}})"),
       "__metadata__: value of 'epoch' is a JSON number"},
      {"MetadataNull", make_image(R"({"__metadata__":null})"), "__metadata__ is a JSON null"},
      {"MissingDType", make_image(one_tensor(R"("shape":[1],"data_offsets":[0,1])"), "d"),
       "missing field 'dtype'"},
      {"MissingShape", make_image(one_tensor(R"("dtype":"U8","data_offsets":[0,1])"), "d"),
       "missing field 'shape'"},
      {"MissingOffsets", make_image(one_tensor(R"("dtype":"U8","shape":[1])"), "d"),
       "missing field 'data_offsets'"},
      {"DeepNesting", make_image("{\"w\":" + std::string(100, '[') + std::string(100, ']') + "}"),
       "nests deeper"},
  };
  return cases;
}

class SafetensorsMalformed : public ::testing::TestWithParam<MalformedCase> {};

TEST_P(SafetensorsMalformed, ErrorNamesTheFileAndTheProblem) {
  const MalformedCase& c = GetParam();
  Result<SafetensorsFile> file = SafetensorsFile::parse(c.image, "bad-00001.safetensors");
  ASSERT_FALSE(file.ok());
  const std::string& message = file.message();
  EXPECT_TRUE(message.starts_with("bad-00001.safetensors: ")) << message;
  EXPECT_NE(message.find(c.phrase), std::string::npos)
      << "expected '" << c.phrase << "' in: " << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

INSTANTIATE_TEST_SUITE_P(Safetensors, SafetensorsMalformed, ::testing::ValuesIn(malformed_cases()),
                         [](const ::testing::TestParamInfo<MalformedCase>& case_info) {
                           return std::string(case_info.param.test_name);
                         });

TEST_F(SafetensorsTest, MalformedFileOnDiskNamesThePath) {
  const fs::path path = dir_ / "short.safetensors";
  const std::vector<std::byte> image = make_image("{}");
  write_file_bytes(path, std::span(image).first(5));
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_TRUE(file.message().starts_with(path.string() + ": ")) << file.message();
  EXPECT_NE(file.message().find("too short"), std::string::npos) << file.message();
}

TEST_F(SafetensorsTest, EveryTruncationOfAValidFileIsRejected) {
  const std::vector<std::byte> data = random_bytes(24, 3);
  const fs::path path = dir_ / "full.safetensors";
  ASSERT_TRUE(write_safetensors(path,
                                std::vector<SafetensorsWriteTensor>{
                                    {"a", DType::kF32, {2}, std::span(data).first(8)},
                                    {"b", DType::kI64, {2}, std::span(data).subspan(8)}},
                                {{"k", "v"}})
                  .ok());
  const std::string text = read_file_text(path);
  std::vector<std::byte> image(text.size());
  std::memcpy(image.data(), text.data(), text.size());
  ASSERT_TRUE(SafetensorsFile::parse(image, "full").ok());
  for (size_t n = 0; n < image.size(); ++n) {
    Result<SafetensorsFile> file = SafetensorsFile::parse(std::span(image).first(n), "cut");
    EXPECT_FALSE(file.ok()) << "accepted a file cut to " << n << " bytes";
  }
}

// ---- writer ------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, WriterLeavesOnlyTheTargetBehind) {
  const std::vector<std::byte> data = random_bytes(16, 5);
  const std::vector<SafetensorsWriteTensor> tensors = {{"w", DType::kF16, {8}, data}};
  ASSERT_TRUE(write_safetensors(dir_ / "a.safetensors", tensors).ok());
  ASSERT_TRUE(write_safetensors(dir_ / "a.safetensors", tensors).ok());  // overwrite
  EXPECT_EQ(directory_entries(dir_), std::vector<std::string>{"a.safetensors"});
}

TEST_F(SafetensorsTest, WriterRefusesAMissingDirectory) {
  const std::vector<std::byte> data = random_bytes(4, 5);
  const std::vector<SafetensorsWriteTensor> tensors = {{"w", DType::kF32, {1}, data}};
  const Status status = write_safetensors(dir_ / "missing" / "a.safetensors", tensors);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("a.safetensors"), std::string::npos) << status.message();
  EXPECT_TRUE(directory_entries(dir_).empty());
}

TEST_F(SafetensorsTest, WriterCleansUpWhenTheRenameFails) {
  // The target is a non-empty directory: the temporary file is written, then the rename fails.
  fs::create_directories(dir_ / "a.safetensors" / "inside");
  const std::vector<std::byte> data = random_bytes(4, 5);
  const std::vector<SafetensorsWriteTensor> tensors = {{"w", DType::kF32, {1}, data}};
  const Status status = write_safetensors(dir_ / "a.safetensors", tensors);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("cannot move"), std::string::npos) << status.message();
  EXPECT_EQ(directory_entries(dir_), std::vector<std::string>{"a.safetensors"});
  EXPECT_TRUE(fs::is_directory(dir_ / "a.safetensors" / "inside"));
}

TEST_F(SafetensorsTest, WriterRefusesBadInputAndKeepsTheOldFile) {
  const fs::path path = dir_ / "model.safetensors";
  const std::vector<std::byte> data = random_bytes(8, 9);
  ASSERT_TRUE(
      write_safetensors(path, std::vector<SafetensorsWriteTensor>{{"old", DType::kF32, {2}, data}})
          .ok());
  const std::string before = read_file_text(path);

  struct Refused {
    std::vector<SafetensorsWriteTensor> tensors;
    std::map<std::string, std::string> metadata;
    const char* phrase;
  };
  const std::span<const std::byte> four = std::span(data).first(4);
  const std::vector<Refused> refused = {
      {{{"w", DType::kF32, {1}, four}, {"w", DType::kF32, {1}, four}}, {}, "duplicate tensor name"},
      {{{"__metadata__", DType::kF32, {1}, four}}, {}, "reserved"},
      {{{"__x", DType::kF32, {1}, four}}, {}, "reserved"},
      {{{"w", DType::kF32, {3}, four}}, {}, "data holds 4 bytes but shape [3] x F32 needs 12"},
      {{{"w", DType::kF32, {-1}, four}}, {}, "negative"},
      {{{"w", DType::kU8, {INT64_MAX, 2}, four}}, {}, "overflows"},
      {{{"", DType::kF32, {1}, four}}, {}, "empty"},
      {{{"w\xff", DType::kF32, {1}, four}}, {}, "not valid UTF-8"},
      {{{"w", DType::kF32, {1}, four}}, {{"k", "\xc3"}}, "not valid UTF-8"},
  };
  for (const Refused& r : refused) {
    const Status status = write_safetensors(path, r.tensors, r.metadata);
    ASSERT_FALSE(status.ok()) << r.phrase;
    EXPECT_TRUE(status.message().starts_with(path.string() + ": ")) << status.message();
    EXPECT_NE(status.message().find(r.phrase), std::string::npos)
        << "expected '" << r.phrase << "' in: " << status.message();
    EXPECT_EQ(read_file_text(path), before);
    EXPECT_EQ(directory_entries(dir_), std::vector<std::string>{"model.safetensors"});
  }
  // The old file still reads.
  Result<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_NE(file->find("old"), nullptr);
}

TEST_F(SafetensorsTest, OverwriteReplacesTheContentWhole) {
  const fs::path path = dir_ / "model.safetensors";
  const std::vector<std::byte> big = random_bytes(4096, 1);
  const std::vector<std::byte> small = random_bytes(2, 2);
  ASSERT_TRUE(
      write_safetensors(path, std::vector<SafetensorsWriteTensor>{{"big", DType::kU8, {4096}, big}})
          .ok());
  // An open reader keeps seeing the old file: the writer renames a new inode into place instead
  // of truncating the old one.
  Result<SafetensorsFile> old_file = SafetensorsFile::open(path);
  ASSERT_TRUE(old_file.ok()) << old_file.message();
  ASSERT_TRUE(write_safetensors(
                  path, std::vector<SafetensorsWriteTensor>{{"small", DType::kU8, {2}, small}})
                  .ok());
  Result<SafetensorsFile> new_file = SafetensorsFile::open(path);
  ASSERT_TRUE(new_file.ok()) << new_file.message();
  EXPECT_EQ(new_file->find("big"), nullptr);
  ASSERT_NE(new_file->find("small"), nullptr);
  EXPECT_EQ(fs::file_size(path), 8 + new_file->header_bytes() + 2);
  const SafetensorsTensor* old_big = old_file->find("big");
  ASSERT_NE(old_big, nullptr);
  EXPECT_TRUE(std::equal(old_big->bytes.begin(), old_big->bytes.end(), big.begin()));
  EXPECT_EQ(directory_entries(dir_), std::vector<std::string>{"model.safetensors"});
}

TEST_F(SafetensorsTest, WriterAcceptsARelativePath) {
  const fs::path cwd = fs::current_path();
  fs::current_path(dir_);
  const std::vector<std::byte> data = random_bytes(2, 3);
  const Status status = write_safetensors(
      "rel.safetensors", std::vector<SafetensorsWriteTensor>{{"w", DType::kI16, {}, data}});
  fs::current_path(cwd);
  ASSERT_TRUE(status.ok()) << status.message();
  Result<SafetensorsFile> file = SafetensorsFile::open(dir_ / "rel.safetensors");
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_EQ(file->find("w")->numel(), 1);
}

}  // namespace
}  // namespace e4kv
