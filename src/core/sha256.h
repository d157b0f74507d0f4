// SHA-256 digests (OpenSSL EVP) of memory and of whole files, as lowercase hex. File hashing reads
// in fixed-size chunks and reports progress, so a multi-gigabyte shard can drive a progress bar.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "core/status.h"

namespace e4kv {

// Incremental SHA-256.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(std::span<const std::byte> bytes);
  void update(std::string_view text);
  // The digest as 64 lowercase hex characters; the object is reset afterwards.
  std::string finish_hex();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string sha256_hex(std::span<const std::byte> bytes);
std::string sha256_hex(std::string_view text);

// Called after each chunk with the bytes hashed so far and the file size.
using HashProgress = std::function<void(uint64_t done, uint64_t total)>;

// Digest of the file at `path` (symbolic links are followed). Errors name the file.
Result<std::string> sha256_file(const std::filesystem::path& path,
                                const HashProgress& progress = {});

// True for 64 lowercase hex characters.
bool is_sha256_hex(std::string_view text);

}  // namespace e4kv
