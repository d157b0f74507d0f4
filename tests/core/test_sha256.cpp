// SHA-256 against the FIPS 180-2 vectors, incremental against one-shot, and file hashing across
// several read chunks with progress.
#include "core/sha256.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace e4kv {
namespace {

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(std::string_view()),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex(std::string_view("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(
      sha256_hex(std::string_view("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
      "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_TRUE(is_sha256_hex(sha256_hex(std::string_view("abc"))));
  EXPECT_FALSE(is_sha256_hex("ABC"));
  EXPECT_FALSE(is_sha256_hex(std::string(64, 'G')));
}

TEST(Sha256, IncrementalEqualsOneShotAndResets) {
  const std::string text(1000003, 'a');
  Sha256 hash;
  for (size_t i = 0; i < text.size(); i += 4097) {
    hash.update(std::string_view(text).substr(i, 4097));
  }
  const std::string digest = hash.finish_hex();
  EXPECT_EQ(digest, sha256_hex(std::string_view(text)));
  hash.update(std::string_view("abc"));
  EXPECT_EQ(hash.finish_hex(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, FileAcrossChunksWithProgress) {
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / cat("e4kv_sha256_", ::getpid(), ".bin");
  std::string data(9u << 20, '\0');  // three 4 MiB reads, the last one partial
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>((i * 2654435761u) >> 24);
  {
    std::ofstream out(path, std::ios::binary);
    out << data;
  }
  uint64_t last = 0;
  int calls = 0;
  Result<std::string> digest = sha256_file(path, [&](uint64_t done, uint64_t total) {
    EXPECT_EQ(total, data.size());
    EXPECT_GE(done, last);
    last = done;
    ++calls;
  });
  std::filesystem::remove(path);
  ASSERT_TRUE(digest.ok()) << digest.message();
  EXPECT_EQ(*digest, sha256_hex(std::string_view(data)));
  EXPECT_EQ(last, data.size());
  EXPECT_EQ(calls, 4);  // the start, then one per chunk

  Result<std::string> missing = sha256_file(path);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find(path.string() + ": cannot open: no such file or directory"), std::string::npos)
      << missing.message();
}

}  // namespace
}  // namespace e4kv
