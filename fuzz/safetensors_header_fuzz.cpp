// libFuzzer target for SafetensorsFile::parse. Every input must either be rejected with a one-line
// message naming the source, or accepted with views that tile the data section exactly; ASan sees
// every byte of every view, and any broken property traps.
//
// Built a second time with E4KV_FUZZ_SEED_WRITER defined, the same file is a small program that
// writes the seed corpus (valid files from the writer plus a few hand-built edge cases) to a
// folder, and the regression inputs too large for a corpus (100,000 levels of nesting) to a second.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "io/safetensors.h"

#ifndef E4KV_FUZZ_SEED_WRITER

namespace {

constexpr const char* kSource = "fuzz.safetensors";

void require(bool condition) {
  if (!condition) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> input(reinterpret_cast<const std::byte*>(data), size);
  e4kv::Result<e4kv::SafetensorsFile> parsed = e4kv::SafetensorsFile::parse(input, kSource);
  if (!parsed.ok()) {
    const std::string& message = parsed.message();
    require(message.starts_with(std::string(kSource) + ": "));
    require(message.find('\n') == std::string::npos);
    return 0;
  }
  const e4kv::SafetensorsFile& file = *parsed;
  require(size >= 8 + file.header_bytes());
  const std::byte* section = input.data() + 8 + file.header_bytes();
  const uint64_t section_size = size - 8 - file.header_bytes();

  // Touch every byte so ASan reports a view that leaves the input.
  uint64_t sum = 0;
  uint64_t expected_begin = 0;
  for (const e4kv::SafetensorsTensor& tensor : file.tensors()) {
    require(!tensor.name.empty());
    require(file.find(tensor.name) == &tensor);
    require(tensor.begin == expected_begin);
    require(tensor.end >= tensor.begin);
    require(tensor.bytes.size() == tensor.end - tensor.begin);
    require(tensor.bytes.data() == section + tensor.begin);
    require(tensor.numel() >= 0);
    require(static_cast<uint64_t>(tensor.numel()) * e4kv::dtype_size(tensor.dtype) ==
            tensor.bytes.size());
    for (std::byte b : tensor.bytes) sum += std::to_integer<uint64_t>(b);
    for (int64_t dim : tensor.shape) sum += static_cast<uint64_t>(dim);
    expected_begin = tensor.end;
  }
  require(expected_begin == section_size);
  for (const auto& [key, value] : file.metadata()) {
    for (char c : key) sum += static_cast<unsigned char>(c);
    for (char c : value) sum += static_cast<unsigned char>(c);
  }
  // Keep the sum alive so the reads are not optimized away.
  volatile uint64_t sink = sum;
  (void)sink;
  return 0;
}

#else  // E4KV_FUZZ_SEED_WRITER

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

namespace {

namespace fs = std::filesystem;

std::vector<std::byte> pattern(size_t n) {
  std::vector<std::byte> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 37 + 11) & 0xFF);
  return out;
}

// 8-byte little-endian length, header, data: seeds that do not come from our writer.
void write_raw(const fs::path& path, const std::string& header, const std::string& data) {
  std::string image;
  for (int i = 0; i < 8; ++i) image += static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  image += header;
  image += data;
  std::ofstream(path, std::ios::binary) << image;
}

// `levels` arrays inside one another: "[[[...]]]".
std::string nested(size_t levels) {
  return std::string(levels, '[') + std::string(levels, ']');
}

bool write(const fs::path& path, const std::vector<e4kv::SafetensorsWriteTensor>& tensors,
           const std::map<std::string, std::string>& metadata = {}) {
  const e4kv::Status status = e4kv::write_safetensors(path, tensors, metadata);
  if (!status.ok()) std::fprintf(stderr, "seed writer: %s\n", status.message().c_str());
  return status.ok();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR [REGRESSION_DIR]\n", argv[0]);
    return 2;
  }
  const fs::path dir = argv[1];
  for (int i = 1; i < argc; ++i) {
    std::error_code error;
    fs::create_directories(argv[i], error);
    if (error) {
      std::fprintf(stderr, "seed writer: cannot create %s: %s\n", argv[i], error.message().c_str());
      return 1;
    }
  }
  using e4kv::DType;
  const std::vector<std::byte> bytes = pattern(256);
  const std::span<const std::byte> all(bytes);
  bool ok = true;
  ok &= write(dir / "seed_empty.safetensors", {});
  ok &= write(dir / "seed_metadata.safetensors", {}, {{"format", "pt"}, {"k", "v"}});
  ok &= write(dir / "seed_dtypes.safetensors",
              {{"a.f64", DType::kF64, {2}, all.first(16)},
               {"a.f32", DType::kF32, {2, 2}, all.first(16)},
               {"a.f16", DType::kF16, {3}, all.first(6)},
               {"a.bf16", DType::kBF16, {1, 1}, all.first(2)},
               {"a.e4m3", DType::kF8E4M3, {4}, all.first(4)},
               {"a.e5m2", DType::kF8E5M2, {2}, all.first(2)},
               {"a.i64", DType::kI64, {}, all.first(8)},
               {"a.i32", DType::kI32, {1}, all.first(4)},
               {"a.i16", DType::kI16, {2}, all.first(4)},
               {"a.i8", DType::kI8, {0}, all.first(0)},
               {"a.u64", DType::kU64, {1}, all.first(8)},
               {"a.u32", DType::kU32, {0, 3}, all.first(0)},
               {"a.u16", DType::kU16, {1}, all.first(2)},
               {"a.u8", DType::kU8, {5}, all.first(5)},
               {"a.bool", DType::kBool, {2}, all.first(2)}},
              {{"format", "pt"}});
  ok &= write(dir / "seed_layer.safetensors",
              {{"model.layers.0.self_attn.q_proj.weight", DType::kBF16, {4, 8}, all.first(64)},
               {"model.layers.0.self_attn.k_proj.weight", DType::kBF16, {2, 8}, all.first(32)},
               {"model.norm.weight", DType::kF32, {8}, all.first(32)}});
  // Hand-built: keys out of order, whitespace, trailing-space padding, zero-byte tensors.
  write_raw(dir / "seed_hand.safetensors",
            "{ \"z\" : {\"data_offsets\":[0,0],\"shape\":[0],\"dtype\":\"U8\"},\n"
            "  \"__metadata__\":{\"\xc3\xa9\":\"\\u00e9\\n\"},"
            "\"w\":{\"shape\":[2,1],\"dtype\":\"I16\",\"data_offsets\":[0,4]}}    ",
            "abcd");
  // Near misses of the layout rules: overlap, gap, trailing bytes.
  write_raw(dir / "seed_overlap.safetensors",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
            "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}",
            "abcdef");
  write_raw(dir / "seed_gap.safetensors",
            "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
            "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}",
            "abcdef");
  write_raw(dir / "seed_trailing.safetensors",
            "{\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", "abcdXY");
  // Nesting just past the header's limit (16 levels), and far past it.
  write_raw(dir / "seed_deep.safetensors", "{\"w\":" + nested(20) + "}", "");
  if (argc == 3) {
    write_raw(fs::path(argv[2]) / "deep_tensor.safetensors", "{\"w\":" + nested(100'000) + "}", "");
    write_raw(fs::path(argv[2]) / "deep_metadata.safetensors",
              "{\"__metadata__\":{\"a\":" + nested(100'000) + "}}", "");
  }
  return ok ? 0 : 1;
}

#endif  // E4KV_FUZZ_SEED_WRITER
