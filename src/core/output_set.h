// Outputs made of several files, shared by every e4kv command that writes them:
//
//   - An output lock: a file `.NAME.lock` beside the output NAME (OutputLock), held with flock(2)
//     for the command's life, so a second e4kv writing the same output at the same time is refused
//     with a message naming the lock file and its holder (pid and command line, recorded in the
//     file). The kernel drops a flock when its process dies, kill -9 included, so a lock file left
//     by a killed run blocks nobody: the next run takes it over. A normal exit (success or error)
//     removes the file.
//   - A directory of files that appears at once (write_output_set_dir): the files are written into
//     a temporary directory beside the target (make_temporary_dir_for), synced, and the directory
//     is renamed onto the target once. A reader sees the old set or the new set, never a mix. The
//     target must be new or empty, or, when the caller may replace (--force), hold nothing but
//     files of the set (check_output_set_dir); then the new directory is exchanged with the old
//     one in one renameat2(RENAME_EXCHANGE) and the old one removed.
//   - A test hook: with the environment variable E4KV_TEST_CRASH_AT set to the name given to
//     crash_point(), the process _exit(9)s there, as a SIGKILL at that point would. The points are
//     named by the writers (calib/overlay.h lists its own; write_output_set_dir has
//     "before-publish"; e4kv calibrate has "after-statistics").
#pragma once

#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/file_io.h"
#include "core/status.h"

namespace e4kv {

// The test hook described above.
void crash_point(std::string_view name);

// `.NAME.lock` in the directory of `output` (a file or a directory; a trailing separator is
// ignored).
std::filesystem::path lock_path_for(const std::filesystem::path& output);

class OutputLock {
 public:
  // Creates or opens `lock_path` and takes the lock without waiting. Refused while another process
  // holds it: "<output>: another e4kv is writing it (lock <lock_path> held by pid P: <command>);
  // wait for it to finish or choose another output". The directory of `lock_path` must exist.
  static Result<OutputLock> acquire(const std::filesystem::path& lock_path,
                                    const std::filesystem::path& output);

  OutputLock(OutputLock&& other) noexcept;
  OutputLock& operator=(OutputLock&& other) noexcept;
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;
  ~OutputLock();  // removes the lock file, then releases the lock

  const std::filesystem::path& path() const { return path_; }

 private:
  OutputLock(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  void release();

  std::filesystem::path path_;
  int fd_ = -1;
};

// Whether the directory `dir` may receive the set of files `names` under `rules`: check_output_dir
// when it does not exist or is empty; otherwise it must be a real directory holding only files of
// the set (anything else is refused: the set replaces the directory as a whole), each of which
// check_output_file accepts (so replacing needs rules.force).
Status check_output_set_dir(const std::filesystem::path& dir,
                            std::span<const std::string_view> names, const OutputRules& rules);

struct OutputSetFile {
  std::string name;   // a plain file name
  std::string bytes;  // its contents
};

// Writes `files` into a temporary directory beside `dir` and publishes it as `dir` in one rename
// (see the top of this file). `replace`: a `dir` that holds files of the set by now is exchanged
// for the new one (the caller checked it with check_output_set_dir and rules.force); without it,
// or when `dir` holds anything else, the rename is refused and nothing is replaced. On failure the
// temporary directory is removed and `dir` is as it was.
Status write_output_set_dir(const std::filesystem::path& dir,
                            const std::vector<OutputSetFile>& files, bool replace);

}  // namespace e4kv
