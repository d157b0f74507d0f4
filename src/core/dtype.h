// Element types of checkpoint tensors, named as safetensors names them.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace e4kv {

enum class DType {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU64,
  kU32,
  kU16,
  kU8,
  kBool,
};

// Size of one element in bytes.
size_t dtype_size(DType dtype);
// The safetensors spelling: "F32", "BF16", "F8_E4M3", "BOOL", ...
std::string_view dtype_name(DType dtype);
// Parses the safetensors spelling; nullopt for anything unknown.
std::optional<DType> parse_dtype(std::string_view name);

}  // namespace e4kv
