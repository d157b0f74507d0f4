#include "core/sha256.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "core/file_io.h"

namespace e4kv {

struct Sha256::Impl {
  EVP_MD_CTX* ctx = nullptr;
  Impl() : ctx(EVP_MD_CTX_new()) {
    E4KV_ASSERT(ctx != nullptr, "EVP_MD_CTX_new failed (out of memory)");
    reset();
  }
  ~Impl() { EVP_MD_CTX_free(ctx); }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  void reset() {
    E4KV_ASSERT(EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) == 1, "EVP_DigestInit_ex failed");
  }
};

Sha256::Sha256() : impl_(std::make_unique<Impl>()) {}
Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(std::span<const std::byte> bytes) {
  if (bytes.empty()) return;
  E4KV_ASSERT(EVP_DigestUpdate(impl_->ctx, bytes.data(), bytes.size()) == 1,
              "EVP_DigestUpdate failed");
}

void Sha256::update(std::string_view text) {
  update(std::as_bytes(std::span<const char>(text.data(), text.size())));
}

std::string Sha256::finish_hex() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  E4KV_ASSERT(EVP_DigestFinal_ex(impl_->ctx, digest, &length) == 1 && length == 32,
              "EVP_DigestFinal_ex failed");
  impl_->reset();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex(64, '0');
  for (unsigned int i = 0; i < length; ++i) {
    hex[2 * i] = kHex[digest[i] >> 4];
    hex[2 * i + 1] = kHex[digest[i] & 0xF];
  }
  return hex;
}

std::string sha256_hex(std::span<const std::byte> bytes) {
  Sha256 hash;
  hash.update(bytes);
  return hash.finish_hex();
}

std::string sha256_hex(std::string_view text) {
  Sha256 hash;
  hash.update(text);
  return hash.finish_hex();
}

Result<std::string> sha256_file(const std::filesystem::path& path, const HashProgress& progress) {
  E4KV_ASSIGN_OR_RETURN(const int fd, open_regular_file(path));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const off_t end = ::lseek(fd, 0, SEEK_END);
  if (end < 0 || ::lseek(fd, 0, SEEK_SET) != 0) {
    return Status::error(cat(path.string(), ": cannot seek: ", errno_message(errno)));
  }
  const uint64_t total = static_cast<uint64_t>(end);
  constexpr size_t kChunk = size_t(4) << 20;
  std::vector<std::byte> buffer(kChunk);
  Sha256 hash;
  uint64_t done = 0;
  if (progress) progress(0, total);
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::error(
          cat(path.string(), ": read failed while hashing: ", errno_message(errno)));
    }
    if (n == 0) break;
    hash.update(std::span<const std::byte>(buffer.data(), static_cast<size_t>(n)));
    done += static_cast<uint64_t>(n);
    if (progress) progress(done, total);
  }
  return hash.finish_hex();
}

bool is_sha256_hex(std::string_view text) {
  if (text.size() != 64) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace e4kv
