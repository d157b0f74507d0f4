// safetensors files: a strict, zero-copy reader over a memory mapping and an atomic writer.
//
// Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON
// {"name": {"dtype": "F16", "shape": [...], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value"}}, then the data section. Offsets are relative to the data
//  section.
// The reader accepts exactly what a conforming writer produces: every problem is an error that
// names the file and the tensor or field (see parse()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/mapped_file.h"
#include "core/status.h"

namespace e4kv {

// Largest header accepted (bytes of JSON).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100ull * 1000 * 1000;

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // offsets within the data section
  uint64_t end = 0;
  std::span<const std::byte> bytes;  // view into the file's mapping (or the parsed buffer)

  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates it.
  static Result<SafetensorsFile> open(const std::filesystem::path& path);

  // Validates a whole file image held in memory; the returned views point into `bytes`, which must
  // outlive the result. `source` names the data in error messages. Checks, each a clear error:
  // file shorter than 8 bytes; header length beyond the file or over kSafetensorsMaxHeaderBytes;
  // header not valid UTF-8 JSON or not an object; duplicate names; names that are empty or not
  // UTF-8; entries that are not objects or lack dtype/shape/data_offsets; unknown dtype; negative
  // or non-integer shape entries; element count overflow; begin > end; numel * dtype size != end -
  // begin; ranges outside the data section; overlapping ranges; gaps or trailing bytes in the data
  // section (a conforming writer packs tensors back to back); __metadata__ that is not a
  // string->string map.
  static Result<SafetensorsFile> parse(std::span<const std::byte> bytes, std::string source);

  // Tensors in data-section order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const SafetensorsTensor* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& source() const { return source_; }
  uint64_t header_bytes() const { return header_bytes_; }

 private:
  MappedFile mapping_;  // empty when built by parse()
  std::string source_;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
  uint64_t header_bytes_ = 0;
};

struct SafetensorsWriteTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;  // numel * dtype_size bytes
};

// Writes a safetensors file atomically: a temporary file in the same directory, fsync, rename over
// `path`, fsync of the directory. The header is padded with spaces to a multiple of 8 bytes.
// Tensors are stored in the given order. Refuses duplicate names, a data size that does not match
// the shape, and names starting with "__". On any failure no temporary file is left beside `path`,
// and an existing file at `path` is untouched unless the rename happened (only a failed sync of the
// directory after the rename reports an error with the new file already in place).
Status write_safetensors(const std::filesystem::path& path,
                         std::span<const SafetensorsWriteTensor> tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace e4kv
