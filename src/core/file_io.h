// Whole-file reads and writes with the rules every e4kv command follows:
//   - inputs must be regular files (a FIFO or a device is refused, never read), read with a size
//     bound, and errors carry the real errno ("permission denied", "too many levels of symbolic
//     links"), never a bare "not found";
//   - outputs are written to a temporary name in the target's directory, synced, and renamed into
//     place, so a crash or kill -9 leaves either the old file or the new one under the final name;
//   - an output may not be one of the command's inputs, may not lie inside a checkpoint directory,
//     and may not replace an existing file unless the caller says so (the CLI's --force);
//   - nothing is written into the root directory: an output may be neither / itself nor an entry
//     directly in / (check_not_in_root), whatever the command.
// Sets of files that must appear together, output locks and the test crash hook: core/output_set.h.
// Messages name the path and the reason; they never name a CLI flag (the CLI adds it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace e4kv {

// Text and JSON inputs (config.json, tokenizer.json, statistics, scales) are far below this; a
// larger file is refused before it is read. Weights are memory-mapped (MappedFile), not read here.
inline constexpr size_t kMaxReadBytes = size_t{1} << 30;  // 1 GiB

// "permission denied" etc. for an errno value (strerror, lower-cased first letter).
std::string errno_message(int error);

// Reads the whole regular file at `path` (symlinks followed). Errors: the file is missing or cannot
// be opened (with errno's reason), is not a regular file (says what it is: directory, FIFO,
// character device, socket ...), is larger than max_bytes, or a read fails.
Result<std::string> read_file(const std::filesystem::path& path, size_t max_bytes = kMaxReadBytes);

// Opens `path` read-only (symlinks followed) without blocking on a FIFO, and checks it is a regular
// file; returns the descriptor (the caller closes it) or read_file's errors. `size` gets the size.
Result<int> open_regular_file(const std::filesystem::path& path, uint64_t* size = nullptr);

// As read_file, but a path that does not exist (ENOENT; not a dangling symlink, a symlink loop or a
// permission error, which are errors) reads as nullopt.
Result<std::optional<std::string>> read_optional_file(const std::filesystem::path& path,
                                                      size_t max_bytes = kMaxReadBytes);

// Checks that `path` names an existing regular file (symlinks followed), with the same messages as
// read_file; for inputs that are opened later by other means.
Status check_regular_file(const std::filesystem::path& path);

// True when `dir` looks like a model checkpoint directory: it holds config.json, a *.safetensors
// file or model.safetensors.index.json.
bool is_checkpoint_dir(const std::filesystem::path& dir);

// Refuses `path` when it resolves (symlinks of its existing part followed, "." and ".." folded) to
// the root directory / or to an entry directly in it: a file there, a directory created there, and
// the temporary and lock files beside such an output would all be written into /.
Status check_not_in_root(const std::filesystem::path& path);

struct OutputRules {
  bool force = false;                        // replacing an existing regular file is allowed
  std::vector<std::filesystem::path> inputs;  // files and directories the command reads
  // How the caller spells the permission to replace, for the refusal's advice (the CLI:
  // "--force"); empty: the advice names none.
  std::string force_name;
};

// Whether the file `path` may be written under `rules`. Refused: check_not_in_root; an existing
// path that is not a regular file; an existing file unless rules.force; the same file as any input
// (compared by device and inode, and by canonical path), or a path inside an input directory; a
// path inside a checkpoint directory (is_checkpoint_dir of its directory or any ancestor). The
// parent directory must exist.
Status check_output_file(const std::filesystem::path& path, const OutputRules& rules);

// Whether the directory `path` may be created and filled under `rules`: check_not_in_root; it must
// not exist or be an empty directory; it must not be (or be inside) an input, nor lie inside a
// checkpoint directory (any ancestor). The parent directory must exist.
Status check_output_dir(const std::filesystem::path& path, const OutputRules& rules);

// A fresh, empty temporary directory `.NAME.tmp.PID.N` beside `path`, to be filled and then renamed
// onto `path` (rename replaces an empty directory). The caller removes it on failure.
Result<std::filesystem::path> make_temporary_dir_for(const std::filesystem::path& path);

// rename(from, to) with errno's reason in the error.
Status rename_path(const std::filesystem::path& from, const std::filesystem::path& to);

// Writes `bytes` to `path` atomically: a new temporary file `.NAME.tmp.PID.N` in the same
// directory (O_EXCL), every byte written, fsync, rename over `path`, fsync of the directory. On any
// error the temporary file is removed and `path` is untouched. Does not apply OutputRules: call
// check_output_file first for user-named outputs.
Status write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

// The temporary name write_file_atomic uses for `path` (tests look for it).
bool is_temporary_name_for(const std::filesystem::path& candidate, const std::filesystem::path& path);

}  // namespace e4kv
