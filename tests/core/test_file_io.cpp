// core/file_io: bounded reads of regular files only, with the real errno in every message; output
// rules (never an input, never inside a checkpoint, never over a file without force); atomic writes
// that a kill -9 cannot leave half-written under the final name.
#include "core/file_io.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "core/mapped_file.h"
#include "core/sha256.h"
#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::read_text;
using testing_support::TempDir;
using testing_support::write_text;

void expect_error(const Status& status, const std::string& needle) {
  ASSERT_FALSE(status.ok()) << "expected an error containing \"" << needle << "\"";
  EXPECT_NE(status.message().find(needle), std::string::npos) << status.message();
}

TEST(FileIo, ReadsARegularFileAndFollowsSymlinks) {
  TempDir dir;
  write_text(dir.path() / "a.json", "{\"x\": 1}\n");
  fs::create_symlink(dir.path() / "a.json", dir.path() / "link.json");
  EXPECT_EQ(read_file(dir.path() / "a.json").value(), "{\"x\": 1}\n");
  EXPECT_EQ(read_file(dir.path() / "link.json").value(), "{\"x\": 1}\n");
  write_text(dir.path() / "empty", "");
  EXPECT_EQ(read_file(dir.path() / "empty").value(), "");
}

TEST(FileIo, MissingFileSaysSo) {
  TempDir dir;
  expect_error(read_file(dir.path() / "nope.json").status(), "no such file or directory");
}

TEST(FileIo, FifoIsRefusedWithoutBlocking) {
  TempDir dir;
  const fs::path fifo = dir.path() / "config.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // No writer ever opens the FIFO: a blocking open would hang this test.
  expect_error(read_file(fifo).status(), "FIFO");
  expect_error(check_regular_file(fifo), "FIFO");
}

TEST(FileIo, DevicesAndDirectoriesAreRefused) {
  TempDir dir;
  expect_error(read_file("/dev/zero").status(), "character device");
  expect_error(read_file(dir.path()).status(), "a directory");
  expect_error(check_regular_file(dir.path()), "a directory");
}

// The weights' memory map and the provenance hashes open files the same way.
TEST(FileIo, MappedAndHashedInputsRefuseSpecialFiles) {
  TempDir dir;
  const fs::path fifo = dir.path() / "model.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error(MappedFile::open(fifo).status(), "FIFO");
  expect_error(sha256_file(fifo).status(), "FIFO");
  expect_error(MappedFile::open("/dev/zero").status(), "character device");
  expect_error(sha256_file("/dev/zero").status(), "character device");
}

TEST(FileIo, SymlinkLoopReportsTheRealErrno) {
  TempDir dir;
  fs::create_symlink(dir.path() / "b", dir.path() / "a");
  fs::create_symlink(dir.path() / "a", dir.path() / "b");
  const Result<std::string> text = read_file(dir.path() / "a");
  expect_error(text.status(), "too many levels of symbolic links");
  EXPECT_EQ(text.message().find("not found"), std::string::npos) << text.message();
  // An optional file that is a loop is an error too, never "absent".
  expect_error(read_optional_file(dir.path() / "a").status(), "too many levels");
}

TEST(FileIo, PermissionErrorReportsTheRealErrno) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads every file";
  TempDir dir;
  write_text(dir.path() / "secret.json", "{}");
  fs::permissions(dir.path() / "secret.json", fs::perms::none);
  expect_error(read_file(dir.path() / "secret.json").status(), "permission denied");
}

TEST(FileIo, OptionalFileAbsentOnlyWhenItDoesNotExist) {
  TempDir dir;
  EXPECT_FALSE(read_optional_file(dir.path() / "absent.json").value().has_value());
  write_text(dir.path() / "there.json", "x");
  EXPECT_EQ(read_optional_file(dir.path() / "there.json").value().value(), "x");
  fs::create_symlink(dir.path() / "nowhere", dir.path() / "dangling.json");
  expect_error(read_optional_file(dir.path() / "dangling.json").status(), "no such file");
}

TEST(FileIo, SizeBoundIsEnforced) {
  TempDir dir;
  write_text(dir.path() / "big", std::string(1000, 'x'));
  EXPECT_EQ(read_file(dir.path() / "big", 1000).value().size(), 1000u);
  expect_error(read_file(dir.path() / "big", 999).status(), "more than the 999 bytes");
}

TEST(FileIo, CheckpointDirectoryDetection) {
  TempDir dir;
  fs::create_directories(dir.path() / "a");
  fs::create_directories(dir.path() / "b");
  fs::create_directories(dir.path() / "c");
  write_text(dir.path() / "a" / "config.json", "{}");
  write_text(dir.path() / "b" / "model-00001-of-00002.safetensors", "");
  write_text(dir.path() / "c" / "notes.txt", "");
  EXPECT_TRUE(is_checkpoint_dir(dir.path() / "a"));
  EXPECT_TRUE(is_checkpoint_dir(dir.path() / "b"));
  EXPECT_FALSE(is_checkpoint_dir(dir.path() / "c"));
  EXPECT_FALSE(is_checkpoint_dir(dir.path() / "missing"));
}

TEST(FileIo, OutputMayNotBeAnInput) {
  TempDir dir;
  const fs::path input = dir.path() / "stats.jsonl";
  write_text(input, "data");
  OutputRules rules;
  rules.force = true;  // even with force
  rules.inputs = {input};
  expect_error(check_output_file(input, rules), "is the input");
  // The same file through another name: a relative path, a symlink, a hard link.
  fs::create_symlink(input, dir.path() / "alias.jsonl");
  fs::create_hard_link(input, dir.path() / "hard.jsonl");
  expect_error(check_output_file(dir.path() / "alias.jsonl", rules), "is the input");
  expect_error(check_output_file(dir.path() / "hard.jsonl", rules), "is the input");
  expect_error(check_output_file(dir.path() / "." / "stats.jsonl", rules), "is the input");
  EXPECT_EQ(read_text(input), "data");
}

TEST(FileIo, OutputMayNotLieInsideACheckpointOrAnInputDirectory) {
  TempDir dir;
  const fs::path ckpt = dir.path() / "ckpt";
  fs::create_directories(ckpt / "sub");
  write_text(ckpt / "config.json", "{}");
  write_text(ckpt / "model.safetensors", "weights");
  OutputRules rules;
  rules.force = true;
  expect_error(check_output_file(ckpt / "model.safetensors", rules), "inside the checkpoint");
  expect_error(check_output_file(ckpt / "new.json", rules), "inside the checkpoint");
  expect_error(check_output_file(ckpt / "sub" / "new.json", rules), "inside the checkpoint");
  expect_error(check_output_dir(ckpt / "derived", rules), "inside the checkpoint");
  EXPECT_EQ(read_text(ckpt / "model.safetensors"), "weights");

  const fs::path inputs = dir.path() / "inputs";
  fs::create_directories(inputs);
  rules.inputs = {inputs};
  expect_error(check_output_file(inputs / "out.json", rules), "inside the input directory");
  expect_error(check_output_dir(inputs, rules), "is the input");
}

TEST(FileIo, ExistingOutputNeedsForce) {
  TempDir dir;
  const fs::path out = dir.path() / "scales.json";
  OutputRules rules;
  EXPECT_TRUE(check_output_file(out, rules).ok());
  write_text(out, "old");
  expect_error(check_output_file(out, rules), "exists; choose a new path");
  EXPECT_EQ(check_output_file(out, rules).message().find("--force"), std::string::npos);
  rules.force_name = "--force";  // the caller's spelling goes into the advice
  expect_error(check_output_file(out, rules), "or use --force to replace it");
  rules.force = true;
  EXPECT_TRUE(check_output_file(out, rules).ok());
  // Force never replaces something that is not a file.
  fs::create_directories(dir.path() / "adir");
  expect_error(check_output_file(dir.path() / "adir", rules), "a directory");
  expect_error(check_output_file(dir.path() / "missing" / "x.json", rules), "no such file");
}

TEST(FileIo, OutputDirectoryRules) {
  TempDir dir;
  OutputRules rules;
  EXPECT_TRUE(check_output_dir(dir.path() / "new", rules).ok());
  fs::create_directories(dir.path() / "empty");
  EXPECT_TRUE(check_output_dir(dir.path() / "empty", rules).ok());
  fs::create_directories(dir.path() / "full");
  write_text(dir.path() / "full" / "x", "x");
  expect_error(check_output_dir(dir.path() / "full", rules), "not empty");
  write_text(dir.path() / "file", "x");
  expect_error(check_output_dir(dir.path() / "file", rules), "regular file");
}

TEST(FileIo, AtomicWriteReplacesAndLeavesNoTemporaryFile) {
  TempDir dir;
  const fs::path out = dir.path() / "out.json";
  ASSERT_TRUE(write_file_atomic(out, "first").ok());
  ASSERT_TRUE(write_file_atomic(out, "second").ok());
  EXPECT_EQ(read_text(out), "second");
  int entries = 0;
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    ++entries;
    EXPECT_FALSE(is_temporary_name_for(entry.path(), out)) << entry.path();
  }
  EXPECT_EQ(entries, 1);
  expect_error(write_file_atomic(dir.path() / "missing" / "x", "x"), "no such file");
}

// A child process writes a large file and is killed with SIGKILL as soon as its temporary file
// appears: the final name must still hold the old contents, complete.
TEST(FileIo, KillDuringAtomicWriteLeavesTheOldFile) {
  TempDir dir;
  const fs::path out = dir.path() / "stats.jsonl";
  write_text(out, "old complete contents\n");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const std::string big(size_t{512} << 20, 'x');
    const Status status = write_file_atomic(out, big);
    ::_exit(status.ok() ? 0 : 3);
  }
  bool seen = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!seen && std::chrono::steady_clock::now() < deadline) {
    for (const auto& entry : fs::directory_iterator(dir.path())) {
      if (is_temporary_name_for(entry.path(), out)) seen = true;
    }
    if (!seen) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(seen) << "the child never created its temporary file";
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child finished its 512 MiB write before the kill";
  EXPECT_EQ(read_text(out), "old complete contents\n");
}

}  // namespace
}  // namespace e4kv
