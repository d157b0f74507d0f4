#include "core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <system_error>

namespace e4kv {
namespace fs = std::filesystem;

std::string errno_message(int error) {
  std::string text = std::strerror(error);
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return text;
}

namespace {

std::string describe_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

Status not_regular(const fs::path& path, mode_t mode) {
  return Status::error(
      cat(path.string(), ": is ", describe_kind(mode), ", expected a regular file"));
}

// Opens `path` for reading without blocking on a FIFO and checks it is a regular file.
Result<int> open_regular(const fs::path& path, struct stat& st) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int error = errno;
    return Status::error(cat(path.string(), ": cannot open: ", errno_message(error)));
  }
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return Status::error(cat(path.string(), ": cannot stat: ", errno_message(error)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return not_regular(path, st.st_mode);
  }
  return fd;
}

class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  int fd_;
};

// The canonical form of `path` when it (or its longest existing prefix) can be resolved.
fs::path canonical_or_absolute(const fs::path& path) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);
  if (ec) return path.lexically_normal();
  fs::path resolved = fs::weakly_canonical(absolute, ec);
  if (ec) resolved = absolute;
  return resolved.lexically_normal();
}

bool is_within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

// The refusals shared by files and directories: inside an input directory or the input itself,
// inside a checkpoint directory.
Status check_not_in_inputs_or_checkpoint(const fs::path& path, const fs::path& resolved,
                                         const OutputRules& rules) {
  const std::string name = path.string();
  for (fs::path dir = resolved.parent_path();; dir = dir.parent_path()) {
    if (is_checkpoint_dir(dir)) {
      return Status::error(cat(name, ": is inside the checkpoint directory ", dir.string(),
                               "; e4kv never writes into a checkpoint, write elsewhere"));
    }
    if (dir == dir.root_path() || !dir.has_relative_path()) break;
  }
  for (const fs::path& input : rules.inputs) {
    if (input.empty()) continue;
    std::error_code ec;
    const fs::path input_resolved = canonical_or_absolute(input);
    if (input_resolved == resolved) {
      return Status::error(cat(name, ": is the input ", input.string(),
                               "; write the output to another path"));
    }
    if (fs::is_directory(input, ec) && is_within(resolved, input_resolved)) {
      return Status::error(cat(name, ": is inside the input directory ", input.string(),
                               "; e4kv never writes into its inputs, write elsewhere"));
    }
  }
  return ok_status();
}

}  // namespace

Result<int> open_regular_file(const fs::path& path, uint64_t* size) {
  struct stat st {};
  E4KV_ASSIGN_OR_RETURN(const int fd, open_regular(path, st));
  // Later reads block normally.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  if (size != nullptr) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

Result<std::string> read_file(const fs::path& path, size_t max_bytes) {
  struct stat st {};
  E4KV_ASSIGN_OR_RETURN(const int fd, open_regular(path, st));
  FdCloser closer(fd);
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return Status::error(cat(path.string(), ": is ", st.st_size, " bytes, more than the ",
                             max_bytes, " bytes e4kv reads from such a file"));
  }
  std::string text;
  text.resize(static_cast<size_t>(st.st_size));
  size_t done = 0;
  // Read until EOF, but never past the bound (the file may grow while it is read).
  for (;;) {
    if (done == text.size()) {
      if (text.size() >= max_bytes + 1) break;
      text.resize(std::min(max_bytes + 1, text.size() + 65536));
    }
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      return Status::error(cat(path.string(), ": read failed: ", errno_message(error)));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  if (done > max_bytes) {
    return Status::error(cat(path.string(), ": grew past the ", max_bytes,
                             " bytes e4kv reads from such a file while it was read"));
  }
  text.resize(done);
  return text;
}

Result<std::optional<std::string>> read_optional_file(const fs::path& path, size_t max_bytes) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT) return std::optional<std::string>();
  E4KV_ASSIGN_OR_RETURN(std::string text, read_file(path, max_bytes));
  return std::optional<std::string>(std::move(text));
}

Status check_regular_file(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int error = errno;
    return Status::error(cat(path.string(), ": cannot open: ", errno_message(error)));
  }
  if (!S_ISREG(st.st_mode)) return not_regular(path, st.st_mode);
  return ok_status();
}

bool is_checkpoint_dir(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  if (fs::exists(dir / "config.json", ec) || fs::exists(dir / "model.safetensors.index.json", ec)) {
    return true;
  }
  fs::directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec);
  if (ec) return false;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return false;
    if (it->path().extension() == ".safetensors") return true;
  }
  return false;
}

Status check_not_in_root(const fs::path& path) {
  fs::path resolved = canonical_or_absolute(path);
  if (!resolved.has_filename() && resolved.has_relative_path()) resolved = resolved.parent_path();
  const bool is_root = !resolved.has_relative_path();
  if (!is_root && resolved.parent_path().has_relative_path()) return ok_status();
  return Status::error(
      cat(path.string(), ": ",
          is_root ? "is the root directory /" : "lies directly in the root directory /",
          "; e4kv writes nothing into /, give a path inside a directory"));
}

Status check_output_file(const fs::path& path, const OutputRules& rules) {
  const std::string name = path.string();
  if (path.empty()) return Status::error("an empty output path");
  E4KV_RETURN_IF_ERROR(check_not_in_root(path));
  if (path.filename().empty() || path.filename() == "." || path.filename() == "..") {
    return Status::error(cat(name, ": names a directory; give a file name"));
  }
  const fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
  struct stat parent_st {};
  if (::stat(parent.c_str(), &parent_st) != 0) {
    const int error = errno;
    return Status::error(
        cat(name, ": cannot use the directory ", parent.string(), ": ", errno_message(error)));
  }
  if (!S_ISDIR(parent_st.st_mode)) {
    return Status::error(cat(name, ": ", parent.string(), " is not a directory"));
  }

  struct stat st {};
  const bool exists = ::lstat(path.c_str(), &st) == 0;
  if (exists) {
    struct stat target {};
    if (S_ISLNK(st.st_mode) && ::stat(path.c_str(), &target) == 0) st = target;
    if (!S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
      return Status::error(cat(name, ": exists and is ", describe_kind(st.st_mode),
                               "; give the path of a file to write"));
    }
  }

  const fs::path resolved = canonical_or_absolute(path);
  for (const fs::path& input : rules.inputs) {
    struct stat input_st {};
    if (exists && !input.empty() && ::stat(input.c_str(), &input_st) == 0 &&
        input_st.st_dev == st.st_dev && input_st.st_ino == st.st_ino) {
      return Status::error(cat(name, ": is the input ", input.string(),
                               "; write the output to another path"));
    }
  }
  E4KV_RETURN_IF_ERROR(check_not_in_inputs_or_checkpoint(path, resolved, rules));
  if (exists && !rules.force) {
    return Status::error(cat(name, ": exists; choose a new path",
                             rules.force_name.empty()
                                 ? std::string()
                                 : cat(", or use ", rules.force_name, " to replace it")));
  }
  return ok_status();
}


Status check_output_dir(const fs::path& path, const OutputRules& rules) {
  const std::string name = path.string();
  if (path.empty()) return Status::error("an empty output path");
  E4KV_RETURN_IF_ERROR(check_not_in_root(path));
  const fs::path resolved = canonical_or_absolute(path);
  const fs::path parent = resolved.parent_path();
  struct stat st {};
  if (::stat(parent.c_str(), &st) != 0) {
    const int error = errno;
    return Status::error(
        cat(name, ": cannot use the directory ", parent.string(), ": ", errno_message(error)));
  }
  if (!S_ISDIR(st.st_mode)) return Status::error(cat(name, ": ", parent.string(), " is not a directory"));
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      return Status::error(cat(name, ": exists and is ",
                               S_ISLNK(st.st_mode) ? std::string("a symbolic link")
                                                   : describe_kind(st.st_mode),
                               "; give a new directory"));
    }
    std::error_code ec;
    if (!fs::is_empty(path, ec) || ec) {
      return Status::error(cat(name, ": directory ", ec ? cat("cannot be read: ", ec.message())
                                                        : std::string("is not empty"),
                               "; give a new or empty directory"));
    }
  } else if (errno != ENOENT) {
    const int error = errno;
    return Status::error(cat(name, ": cannot stat: ", errno_message(error)));
  }
  return check_not_in_inputs_or_checkpoint(path, resolved, rules);
}

Result<fs::path> make_temporary_dir_for(const fs::path& path) {
  static std::atomic<uint64_t> counter{0};
  const fs::path resolved = canonical_or_absolute(path);
  const fs::path temp = resolved.parent_path() / cat(".", resolved.filename().string(), ".tmp.",
                                                     ::getpid(), ".", counter.fetch_add(1));
  if (::mkdir(temp.c_str(), 0755) != 0) {
    const int error = errno;
    return Status::error(cat(path.string(), ": cannot create the temporary directory ",
                             temp.string(), ": ", errno_message(error)));
  }
  return temp;
}

Status rename_path(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    const int error = errno;
    return Status::error(
        cat(to.string(), ": cannot move ", from.string(), " into place: ", errno_message(error)));
  }
  return ok_status();
}

Status write_file_atomic(const fs::path& path, std::string_view bytes) {
  static std::atomic<uint64_t> counter{0};
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  const fs::path temp =
      dir / cat(".", path.filename().string(), ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int error = errno;
    return Status::error(cat(path.string(), ": cannot create the temporary file ", temp.string(),
                             ": ", errno_message(error)));
  }
  auto fail = [&](std::string message) {
    ::close(fd);
    ::unlink(temp.c_str());
    return Status::error(std::move(message));
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      return fail(cat(path.string(), ": write failed: ", errno_message(error)));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int error = errno;
    return fail(cat(path.string(), ": cannot sync: ", errno_message(error)));
  }
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    return Status::error(cat(path.string(), ": close failed: ", errno_message(error)));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    return Status::error(cat(path.string(), ": cannot move the temporary file into place: ",
                             errno_message(error)));
  }
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);  // best effort: the file is complete either way
    ::close(dir_fd);
  }
  return ok_status();
}

bool is_temporary_name_for(const fs::path& candidate, const fs::path& path) {
  const std::string prefix = cat(".", path.filename().string(), ".tmp.");
  return candidate.filename().string().starts_with(prefix);
}

}  // namespace e4kv
