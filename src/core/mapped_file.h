// A read-only memory mapping of a whole file (RAII, move-only).
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>

#include "core/status.h"

namespace e4kv {

class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Maps `path` read-only. An empty file maps to an empty span.
  static Result<MappedFile> open(const std::filesystem::path& path);

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }

 private:
  void reset();
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace e4kv
