// core/output_set.h and check_not_in_root (core/file_io.h): the output lock, a directory of files
// published at once, and the root-directory rule.
#include "core/output_set.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <array>
#include <filesystem>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "testing/files.h"

namespace e4kv {
namespace {

namespace fs = std::filesystem;
using testing_support::read_text;
using testing_support::TempDir;
using testing_support::write_text;

std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

TEST(OutputSet, RootAndEntriesDirectlyInItAreRefused) {
  for (const char* path : {"/", "/x.json", "/tmp/../x.json", "/new-dir/", "/./y"}) {
    const Status st = check_not_in_root(path);
    EXPECT_FALSE(st.ok()) << path;
    EXPECT_NE(st.message().find("e4kv writes nothing into /"), std::string::npos) << st.message();
  }
  EXPECT_NE(check_not_in_root("/").message().find("is the root directory /"), std::string::npos);
  EXPECT_NE(check_not_in_root("/x").message().find("lies directly in the root directory /"),
            std::string::npos);
  TempDir tmp;
  EXPECT_TRUE(check_not_in_root(tmp.path() / "x.json").ok());
  EXPECT_TRUE(check_not_in_root("/tmp/x").ok());
  EXPECT_TRUE(check_not_in_root("relative/x").ok());
  // A symbolic link to / is /.
  fs::create_directory_symlink("/", tmp.path() / "root");
  EXPECT_FALSE(check_not_in_root(tmp.path() / "root").ok());
  EXPECT_FALSE(check_not_in_root(tmp.path() / "root" / "x.json").ok());
  // The checks of every output apply it.
  EXPECT_FALSE(check_output_file("/x.json", OutputRules{}).ok());
  EXPECT_FALSE(check_output_dir("/", OutputRules{}).ok());
  EXPECT_FALSE(check_output_dir("/x", OutputRules{}).ok());
}

TEST(OutputSet, LockIsExclusiveNamesItsHolderAndIsRemovedOnRelease) {
  TempDir tmp;
  const fs::path lock_path = tmp.path() / ".out.lock";
  EXPECT_EQ(lock_path_for(tmp.path() / "out"), lock_path);
  EXPECT_EQ(lock_path_for(tmp.path() / "out" / ""), lock_path);
  {
    Result<OutputLock> first = OutputLock::acquire(lock_path, tmp.path() / "out");
    ASSERT_TRUE(first.ok()) << first.message();
    // The holder is recorded: this process's pid.
    EXPECT_EQ(read_text(lock_path).rfind(cat("pid ", ::getpid()), 0), 0u) << read_text(lock_path);
    // A second open file is a second holder, even in this process.
    Result<OutputLock> second = OutputLock::acquire(lock_path, tmp.path() / "out");
    ASSERT_FALSE(second.ok());
    EXPECT_NE(second.message().find(cat("another e4kv is writing it (lock ", lock_path.string(),
                                        " held by pid ", ::getpid())),
              std::string::npos)
        << second.message();
  }
  EXPECT_FALSE(fs::exists(lock_path));
  // A lock file nobody holds (a killed run's) is taken over.
  write_text(lock_path, "pid 1: a run that was killed\n");
  {
    Result<OutputLock> lock = OutputLock::acquire(lock_path, tmp.path() / "out");
    ASSERT_TRUE(lock.ok()) << lock.message();
  }
  EXPECT_FALSE(fs::exists(lock_path));
  // A holder that writes control characters cannot break the one-line message.
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  const std::string hostile = "pid 7\r\x1b[2J";
  ASSERT_EQ(::write(fd, hostile.data(), hostile.size()), ssize_t(hostile.size()));
  Result<OutputLock> refused = OutputLock::acquire(lock_path, tmp.path() / "out");
  ::close(fd);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("held by pid 7?"), std::string::npos) << refused.message();
  EXPECT_EQ(refused.message().find('\x1b'), std::string::npos);
}

TEST(OutputSet, DirectoryAppearsAtOnceAndIsReplacedOnlyWhole) {
  TempDir tmp;
  const fs::path dir = tmp.path() / "report";
  const std::array<std::string_view, 2> names = {"a.json", "b.md"};
  EXPECT_TRUE(check_output_set_dir(dir, names, OutputRules{}).ok());
  ASSERT_TRUE(write_output_set_dir(dir, {{"a.json", "1"}, {"b.md", "one"}}, false).ok());
  EXPECT_EQ(entries(dir), (std::set<std::string>{"a.json", "b.md"}));
  EXPECT_EQ(entries(tmp.path()), (std::set<std::string>{"report"}));
  // Existing files of the set need the permission to replace them.
  const Status again = check_output_set_dir(dir, names, OutputRules{});
  EXPECT_NE(again.message().find("a.json: exists"), std::string::npos) << again.message();
  OutputRules force;
  force.force = true;
  EXPECT_TRUE(check_output_set_dir(dir, names, force).ok());
  // Without replace the rename onto a filled directory is refused and nothing changes.
  EXPECT_FALSE(write_output_set_dir(dir, {{"a.json", "2"}, {"b.md", "two"}}, false).ok());
  EXPECT_EQ(read_text(dir / "a.json"), "1");
  // With it the whole set is exchanged.
  ASSERT_TRUE(write_output_set_dir(dir, {{"a.json", "2"}, {"b.md", "two"}}, true).ok());
  EXPECT_EQ(entries(dir), (std::set<std::string>{"a.json", "b.md"}));
  EXPECT_EQ(read_text(dir / "a.json"), "2");
  EXPECT_EQ(read_text(dir / "b.md"), "two");
  EXPECT_EQ(entries(tmp.path()), (std::set<std::string>{"report"}));
  // Anything else in the directory is never replaced with it.
  write_text(dir / "notes.txt", "mine");
  const Status foreign = check_output_set_dir(dir, names, force);
  EXPECT_NE(foreign.message().find("holds notes.txt"), std::string::npos) << foreign.message();
  EXPECT_FALSE(write_output_set_dir(dir, {{"a.json", "3"}, {"b.md", "three"}}, true).ok());
  EXPECT_EQ(read_text(dir / "notes.txt"), "mine");
  EXPECT_EQ(read_text(dir / "a.json"), "2");
  EXPECT_EQ(entries(tmp.path()), (std::set<std::string>{"report"}));
}

}  // namespace
}  // namespace e4kv
