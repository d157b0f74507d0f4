// The safetensors reader validates in three passes: the framing (length field, header bounds,
// UTF-8), the JSON (parsed by nlohmann with a callback that sees every key, because nlohmann keeps
// only the last of duplicate keys), then the layout (each tensor's own fields, then all byte ranges
// sorted by offset, which must tile the data section exactly). Nothing is copied: views point into
// the input.
//
// The writer builds the whole header first, validates everything before creating a file, then
// writes to a temporary file beside the target and renames it over the target.
#include "io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "core/json.h"

namespace e4kv {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr size_t kLengthFieldBytes = 8;
// A valid header nests three levels of objects and arrays ({name: {"shape": [dim]}}); anything far
// deeper is not a safetensors header, and refusing it early bounds the work the JSON parser does.
constexpr int kMaxHeaderDepth = 16;
// Names and values quoted in error messages are cut to this many bytes so a message stays readable.
constexpr size_t kMaxQuotedBytes = 200;

// Offset of the first byte that is not part of well-formed UTF-8 (no overlong forms, no surrogates,
// nothing above U+10FFFF), or nullopt when all of `text` is well formed.
std::optional<size_t> first_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned char lo = 0x80;  // allowed range of the second byte
    unsigned char hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // UTF-16 surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
    }
    i += len;
  }
  return std::nullopt;
}

bool is_utf8(std::string_view text) {
  return !first_invalid_utf8(text).has_value();
}

// `text` in single quotes, safe to put in a one-line message: control characters, quotes,
// backslashes and (when `text` is not UTF-8) bytes >= 0x80 are escaped; long text is cut.
std::string quote(std::string_view text) {
  const bool utf8 = is_utf8(text);
  std::string out = "'";
  size_t shown = 0;
  for (const char ch : text) {
    if (shown == kMaxQuotedBytes) {
      out += cat("...' (", text.size(), " bytes)");
      return out;
    }
    ++shown;
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\'' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c == 0x7F || (c >= 0x80 && !utf8)) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out += ch;
    }
  }
  out += '\'';
  return out;
}

// A JSON value as text for a message, cut like quote().
std::string brief_dump(const Json& value) {
  return json_excerpt(value, kMaxQuotedBytes);
}

std::string format_shape(const std::vector<int64_t>& shape) {
  constexpr size_t kMaxDims = 16;
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i == kMaxDims) {
      out += cat(", ... (", shape.size(), " dimensions)");
      break;
    }
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  out += ']';
  return out;
}

std::string format_range(uint64_t begin, uint64_t end) {
  return cat("[", begin, ", ", end, "]");
}

std::string known_dtype_names() {
  std::string out;
  for (DType d : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3,
                  DType::kF8E5M2, DType::kI64, DType::kI32, DType::kI16, DType::kI8, DType::kU64,
                  DType::kU32, DType::kU16, DType::kU8, DType::kBool}) {
    if (!out.empty()) out += ' ';
    out += dtype_name(d);
  }
  return out;
}

// The product of `shape`, or nullopt when a dimension is negative or the product overflows int64.
std::optional<int64_t> checked_numel(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return std::nullopt;
    if (__builtin_mul_overflow(numel, dim, &numel)) return std::nullopt;
  }
  return numel;
}

// numel * dtype_size(dtype) in bytes, or nullopt on overflow.
std::optional<uint64_t> checked_nbytes(int64_t numel, DType dtype) {
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), dtype_size(dtype), &nbytes)) {
    return std::nullopt;
  }
  return nbytes;
}

uint64_t read_le64(const std::byte* p) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | std::to_integer<uint64_t>(p[i]);
  return value;
}

void append_le64(std::string& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((value >> (8 * i)) & 0xFF);
}

// Parses the header JSON, rejecting duplicate keys in any object and absurd nesting. The caller
// has checked that `text` is UTF-8.
Result<Json> parse_header_json(std::string_view text, const std::string& source) {
  // One set of keys per open object or array (arrays get an unused set to keep the stack simple),
  // plus the tensor name owning the innermost depth-1 value, for messages.
  std::vector<std::set<std::string, std::less<>>> open_keys;
  std::string top_level_key;
  auto no_duplicate_keys = [&](int depth, Json::parse_event_t event, const Json& parsed) -> Status {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        open_keys.emplace_back();
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!open_keys.empty()) open_keys.pop_back();
        break;
      case Json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (open_keys.empty()) break;
        if (!open_keys.back().insert(key).second) {
          if (depth == 1 && key == kMetadataKey) {
            return Status::error(cat(source, ": header has more than one \"__metadata__\" entry"));
          }
          if (depth == 1) {
            return Status::error(cat(source, ": duplicate tensor name ", quote(key),
                                     " in the header (each name must appear once)"));
          }
          return Status::error(cat(source, ": ",
                                   top_level_key == kMetadataKey
                                       ? std::string("__metadata__")
                                       : cat("tensor ", quote(top_level_key)),
                                   ": duplicate key ", quote(key)));
        }
        if (depth == 1) top_level_key = key;
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return ok_status();
  };
  return parse_json(text, cat(source, ": header"), JsonLimits{.max_depth = kMaxHeaderDepth},
                    no_duplicate_keys);
}

// A non-negative JSON integer, or nullopt (negative, fractional, not a number, or beyond uint64).
std::optional<uint64_t> as_non_negative(const Json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    const auto v = value.get<int64_t>();
    if (v >= 0) return static_cast<uint64_t>(v);
  }
  return std::nullopt;
}

// Checks one header entry and fills everything but `bytes`.
Status parse_tensor_entry(const std::string& source, const std::string& name, const Json& entry,
                          uint64_t data_size, SafetensorsTensor& tensor) {
  const std::string where = cat(source, ": tensor ", quote(name), ": ");
  if (!entry.is_object()) {
    return Status::error(cat(where, "entry is a JSON ", entry.type_name(),
                             ", expected an object with dtype, shape and data_offsets"));
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) return Status::error(cat(where, "missing field '", field, "'"));
  }
  tensor.name = name;

  const Json& dtype = entry.at("dtype");
  if (!dtype.is_string()) {
    return Status::error(cat(where, "dtype is a JSON ", dtype.type_name(), ", expected a string"));
  }
  const auto& dtype_text = dtype.get_ref<const std::string&>();
  const std::optional<DType> parsed_dtype = parse_dtype(dtype_text);
  if (!parsed_dtype) {
    return Status::error(
        cat(where, "unknown dtype ", quote(dtype_text), " (known: ", known_dtype_names(), ")"));
  }
  tensor.dtype = *parsed_dtype;

  const Json& shape = entry.at("shape");
  if (!shape.is_array()) {
    return Status::error(
        cat(where, "shape is a JSON ", shape.type_name(), ", expected an array of integers"));
  }
  tensor.shape.clear();
  tensor.shape.reserve(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    const Json& dim = shape[i];
    if (dim.is_number_integer() && !dim.is_number_unsigned() && dim.get<int64_t>() < 0) {
      return Status::error(cat(where, "shape entry ", i, " is negative (", dim.get<int64_t>(),
                               "); dimensions must be >= 0"));
    }
    const std::optional<uint64_t> value = as_non_negative(dim);
    if (!value) {
      return Status::error(
          cat(where, "shape entry ", i, " (", brief_dump(dim), ") is not an integer"));
    }
    if (*value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Status::error(cat(where, "shape entry ", i, " (", *value, ") is too large"));
    }
    tensor.shape.push_back(static_cast<int64_t>(*value));
  }
  const std::optional<int64_t> numel = checked_numel(tensor.shape);
  const std::optional<uint64_t> nbytes =
      numel ? checked_nbytes(*numel, tensor.dtype) : std::nullopt;
  if (!nbytes) {
    return Status::error(cat(where, "shape ", format_shape(tensor.shape), " x ",
                             dtype_name(tensor.dtype), " overflows a 64-bit byte count"));
  }

  const Json& offsets = entry.at("data_offsets");
  std::optional<uint64_t> begin;
  std::optional<uint64_t> end;
  if (offsets.is_array() && offsets.size() == 2) {
    begin = as_non_negative(offsets[0]);
    end = as_non_negative(offsets[1]);
  }
  if (!begin || !end) {
    return Status::error(cat(where, "data_offsets ", brief_dump(offsets),
                             " is not an array of two non-negative integers [begin, end]"));
  }
  tensor.begin = *begin;
  tensor.end = *end;
  const std::string range = format_range(tensor.begin, tensor.end);
  if (tensor.begin > tensor.end) {
    return Status::error(cat(where, "data_offsets ", range, " has begin after end"));
  }
  if (tensor.end - tensor.begin != *nbytes) {
    return Status::error(cat(where, "data_offsets ", range, " hold ", tensor.end - tensor.begin,
                             " bytes but shape ", format_shape(tensor.shape), " x ",
                             dtype_name(tensor.dtype), " needs ", *nbytes));
  }
  if (tensor.end > data_size) {
    return Status::error(cat(where, "data_offsets ", range, " reach outside the data section (",
                             data_size, " bytes)"));
  }
  return ok_status();
}

Status parse_metadata(const std::string& source, const Json& value,
                      std::map<std::string, std::string>& metadata) {
  if (!value.is_object()) {
    return Status::error(cat(source, ": __metadata__ is a JSON ", value.type_name(),
                             ", expected an object of string values"));
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return Status::error(cat(source, ": __metadata__: value of ", quote(key), " is a JSON ",
                               item.type_name(), ", expected a string"));
    }
    metadata.emplace(key, item.get<std::string>());
  }
  return ok_status();
}

// ---- writer helpers
// ------------------------------------------------------------------------------

std::string errno_text(int err) {
  return std::strerror(err);
}

Status write_all(int fd, const void* data, size_t size, const std::string& what) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    // Linux writes at most ~2 GiB per call; ask for 1 GiB at a time.
    const size_t chunk = std::min<size_t>(size, size_t{1} << 30);
    const ssize_t written = ::write(fd, p, chunk);
    if (written < 0) {
      if (errno == EINTR) continue;
      return Status::error(cat(what, ": cannot write: ", errno_text(errno)));
    }
    if (written == 0) return Status::error(cat(what, ": cannot write: no progress"));
    p += written;
    size -= static_cast<size_t>(written);
  }
  return ok_status();
}

Status fsync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return Status::error(
        cat(dir.string(), ": cannot open the directory to sync it: ", errno_text(errno)));
  }
  int err = 0;
  // note: some file systems cannot sync a directory (EINVAL); the rename itself has happened.
  if (::fsync(fd) != 0 && errno != EINVAL) err = errno;
  ::close(fd);
  if (err != 0) {
    return Status::error(cat(dir.string(), ": cannot sync the directory: ", errno_text(err)));
  }
  return ok_status();
}

// Builds the complete header (length field + padded JSON) or says why the input is not writable.
Result<std::string> build_header(const std::string& target,
                                 std::span<const SafetensorsWriteTensor> tensors,
                                 const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) {
      if (!is_utf8(key)) {
        return Status::error(cat(target, ": __metadata__ key ", quote(key), " is not valid UTF-8"));
      }
      if (!is_utf8(value)) {
        return Status::error(
            cat(target, ": __metadata__: value of ", quote(key), " is not valid UTF-8"));
      }
      meta[key] = value;
    }
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const SafetensorsWriteTensor& tensor : tensors) {
    const std::string where = cat(target, ": tensor ", quote(tensor.name), ": ");
    if (tensor.name.empty()) return Status::error(cat(target, ": a tensor name is empty"));
    if (!is_utf8(tensor.name)) return Status::error(cat(where, "name is not valid UTF-8"));
    if (tensor.name.starts_with("__")) {
      return Status::error(cat(where, "names starting with \"__\" are reserved"));
    }
    if (!names.insert(tensor.name).second) {
      return Status::error(cat(where, "duplicate tensor name (each name must appear once)"));
    }
    for (size_t i = 0; i < tensor.shape.size(); ++i) {
      if (tensor.shape[i] < 0) {
        return Status::error(
            cat(where, "shape ", format_shape(tensor.shape), " entry ", i, " is negative"));
      }
    }
    const std::optional<int64_t> numel = checked_numel(tensor.shape);
    const std::optional<uint64_t> nbytes =
        numel ? checked_nbytes(*numel, tensor.dtype) : std::nullopt;
    if (!nbytes) {
      return Status::error(cat(where, "shape ", format_shape(tensor.shape), " x ",
                               dtype_name(tensor.dtype), " overflows a 64-bit byte count"));
    }
    if (tensor.data.size() != *nbytes) {
      return Status::error(cat(where, "data holds ", tensor.data.size(), " bytes but shape ",
                               format_shape(tensor.shape), " x ", dtype_name(tensor.dtype),
                               " needs ", *nbytes));
    }
    uint64_t end = 0;
    if (__builtin_add_overflow(offset, *nbytes, &end)) {
      return Status::error(cat(where, "data section would exceed 2^64 bytes"));
    }
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = std::string(dtype_name(tensor.dtype));
    entry["shape"] = tensor.shape;
    entry["data_offsets"] = nlohmann::ordered_json::array({offset, end});
    header[tensor.name] = std::move(entry);
    offset = end;
  }
  std::string json;
  try {
    json = header.dump();
  } catch (const std::exception& error) {
    return Status::error(cat(target, ": cannot serialize the header: ", error.what()));
  }
  // Padding keeps the data section 8-byte aligned relative to the file start.
  json.append((8 - json.size() % 8) % 8, ' ');
  if (json.size() > kSafetensorsMaxHeaderBytes) {
    return Status::error(cat(target, ": header would be ", json.size(),
                             " bytes, over the limit of ", kSafetensorsMaxHeaderBytes));
  }
  std::string out;
  out.reserve(kLengthFieldBytes + json.size());
  append_le64(out, json.size());
  out += json;
  return out;
}

// Removes the temporary file unless released (the rename consumed it).
class TempFileGuard {
 public:
  explicit TempFileGuard(std::filesystem::path path) : path_(std::move(path)) {}
  ~TempFileGuard() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TempFileGuard(const TempFileGuard&) = delete;
  TempFileGuard& operator=(const TempFileGuard&) = delete;

  void set_fd(int fd) { fd_ = fd; }
  // Closes the descriptor, reporting a failed close (a late write error on some file systems).
  Status close() {
    const int fd = std::exchange(fd_, -1);
    if (fd >= 0 && ::close(fd) != 0) {
      return Status::error(cat(path_.string(), ": cannot close: ", errno_text(errno)));
    }
    return ok_status();
  }
  void release() { path_.clear(); }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::filesystem::path& path) {
  E4KV_ASSIGN_OR_RETURN(MappedFile mapping, MappedFile::open(path));
  const std::span<const std::byte> bytes = mapping.bytes();
  E4KV_ASSIGN_OR_RETURN(SafetensorsFile file, parse(bytes, path.string()));
  // Moving a MappedFile keeps its address, so the views stay valid.
  file.mapping_ = std::move(mapping);
  return file;
}

Result<SafetensorsFile> SafetensorsFile::parse(std::span<const std::byte> bytes,
                                               std::string source) {
  SafetensorsFile file;
  file.source_ = std::move(source);
  const std::string& src = file.source_;
  try {
    if (bytes.size() < kLengthFieldBytes) {
      return Status::error(
          cat(src, ": file is ", bytes.size(), " bytes, too short for the 8-byte header length"));
    }
    const uint64_t header_bytes = read_le64(bytes.data());
    const uint64_t after_length = bytes.size() - kLengthFieldBytes;
    if (header_bytes > kSafetensorsMaxHeaderBytes) {
      return Status::error(cat(src, ": header length ", header_bytes, " exceeds the limit of ",
                               kSafetensorsMaxHeaderBytes, " bytes (not a safetensors file?)"));
    }
    if (header_bytes > after_length) {
      return Status::error(cat(src, ": header length ", header_bytes,
                               " runs past the end of the file (", after_length,
                               " bytes follow the length field; truncated file?)"));
    }
    const std::string_view header_text(
        reinterpret_cast<const char*>(bytes.data() + kLengthFieldBytes), header_bytes);
    if (const std::optional<size_t> bad = first_invalid_utf8(header_text)) {
      const size_t from = *bad >= 24 ? *bad - 24 : 0;
      return Status::error(cat(src, ": header is not valid UTF-8 at byte ", *bad, " (after ",
                               quote(header_text.substr(from, *bad - from)), ")"));
    }
    // The official format starts the header with '{'; checking it first gives a clearer message
    // than the JSON parser for the common "not a safetensors file" case.
    if (header_text.empty() || header_text.front() != '{') {
      return Status::error(cat(src, ": header is not a JSON object (it must start with '{')"));
    }
    E4KV_ASSIGN_OR_RETURN(Json header, parse_header_json(header_text, src));
    if (!header.is_object()) {
      return Status::error(cat(src, ": header is not a JSON object"));
    }

    const std::byte* data = bytes.data() + kLengthFieldBytes + header_bytes;
    const uint64_t data_size = after_length - header_bytes;

    file.header_bytes_ = header_bytes;
    file.tensors_.reserve(header.size());
    for (const auto& [name, entry] : header.items()) {
      if (name == kMetadataKey) {
        E4KV_RETURN_IF_ERROR(parse_metadata(src, entry, file.metadata_));
        continue;
      }
      // The JSON parser accepts only UTF-8, and the framing check above covered the raw bytes;
      // check the decoded name too so the guarantee does not rest on either.
      if (name.empty()) {
        return Status::error(cat(src, ": tensor name is empty (\"\" names an entry)"));
      }
      if (!is_utf8(name)) {
        return Status::error(cat(src, ": tensor name ", quote(name), " is not valid UTF-8"));
      }
      SafetensorsTensor tensor;
      E4KV_RETURN_IF_ERROR(parse_tensor_entry(src, name, entry, data_size, tensor));
      file.tensors_.push_back(std::move(tensor));
    }

    // Sorted by offset the ranges must tile [0, data_size) exactly. Zero-byte tensors sort before
    // a tensor starting at the same offset, so they never count as overlapping it.
    std::sort(file.tensors_.begin(), file.tensors_.end(),
              [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
                return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
              });
    uint64_t expected = 0;
    const SafetensorsTensor* previous = nullptr;
    for (const SafetensorsTensor& tensor : file.tensors_) {
      if (tensor.begin < expected) {
        return Status::error(cat(src, ": tensor ", quote(tensor.name), ": data_offsets ",
                                 format_range(tensor.begin, tensor.end), " overlap tensor ",
                                 quote(previous->name), " at ",
                                 format_range(previous->begin, previous->end)));
      }
      if (tensor.begin > expected) {
        return Status::error(cat(src, ": data section bytes [", expected, ", ", tensor.begin,
                                 ") belong to no tensor (gap before tensor ", quote(tensor.name),
                                 " at ", format_range(tensor.begin, tensor.end), ")"));
      }
      expected = tensor.end;
      previous = &tensor;
    }
    if (expected != data_size) {
      const uint64_t trailing = data_size - expected;
      return Status::error(cat(src, ": data section has ", trailing,
                               trailing == 1 ? " trailing byte" : " trailing bytes",
                               " after the last tensor (bytes [", expected, ", ", data_size,
                               ") belong to no tensor)"));
    }

    for (size_t i = 0; i < file.tensors_.size(); ++i) {
      SafetensorsTensor& tensor = file.tensors_[i];
      tensor.bytes = std::span<const std::byte>(data + tensor.begin, tensor.end - tensor.begin);
      file.index_.emplace(tensor.name, i);
    }
    return file;
  } catch (const std::exception& error) {
    // Defensive: every check above reports through Status; this catches allocation failures and
    // anything nlohmann throws that the checks did not anticipate.
    return Status::error(cat(src, ": cannot read the safetensors header: ", error.what()));
  }
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Status write_safetensors(const std::filesystem::path& path,
                         std::span<const SafetensorsWriteTensor> tensors,
                         const std::map<std::string, std::string>& metadata) {
  const std::string target = path.string();
  if (!path.has_filename()) {
    return Status::error(cat(target, ": the path names no file"));
  }
  Result<std::string> header = [&]() -> Result<std::string> {
    try {
      return build_header(target, tensors, metadata);
    } catch (const std::exception& error) {
      return Status::error(cat(target, ": cannot build the header: ", error.what()));
    }
  }();
  if (!header.ok()) return header.status();

  static std::atomic<uint64_t> counter{0};
  const std::filesystem::path dir = path.has_parent_path() ? path.parent_path() : ".";
  const std::filesystem::path temp =
      dir / cat(".", path.filename().string(), ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    return Status::error(
        cat(target, ": cannot create the temporary file ", temp.string(), ": ", errno_text(errno)));
  }
  TempFileGuard guard(temp);
  guard.set_fd(fd);

  E4KV_RETURN_IF_ERROR(write_all(fd, header->data(), header->size(), temp.string()));
  for (const SafetensorsWriteTensor& tensor : tensors) {
    E4KV_RETURN_IF_ERROR(write_all(fd, tensor.data.data(), tensor.data.size(), temp.string()));
  }
  if (::fsync(fd) != 0) {
    return Status::error(cat(temp.string(), ": cannot sync: ", errno_text(errno)));
  }
  E4KV_RETURN_IF_ERROR(guard.close());
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    return Status::error(
        cat(target, ": cannot move ", temp.string(), " into place: ", errno_text(errno)));
  }
  guard.release();
  return fsync_directory(dir);
}

}  // namespace e4kv
