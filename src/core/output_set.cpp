#include "core/output_set.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <system_error>
#include <utility>

namespace e4kv {
namespace fs = std::filesystem;

namespace {

// `path` made absolute and normal, without a trailing separator ("report/" -> ".../report").
fs::path normal_target(const fs::path& path) {
  std::error_code ec;
  fs::path absolute = fs::absolute(path, ec);
  if (ec) absolute = path;
  absolute = absolute.lexically_normal();
  if (!absolute.has_filename() && absolute.has_relative_path()) absolute = absolute.parent_path();
  return absolute;
}

// What the lock file records of its holder: "pid P: the command line", one line.
std::string holder_text() {
  std::string command;
  if (Result<std::string> cmdline = read_file("/proc/self/cmdline", 4096); cmdline.ok()) {
    command = std::move(cmdline).value();
    while (!command.empty() && command.back() == '\0') command.pop_back();
    std::replace(command.begin(), command.end(), '\0', ' ');
  }
  std::string text = cat("pid ", ::getpid(), command.empty() ? "" : ": ", command);
  if (text.size() > 300) text = text.substr(0, 297) + "...";
  for (char& c : text) {
    if (c < 0x20 || c == 0x7f) c = '?';
  }
  return text;
}

// The holder recorded in an open lock file, made safe for a one-line message.
std::string read_holder(int fd) {
  char buffer[512];
  const ssize_t n = ::pread(fd, buffer, sizeof(buffer) - 1, 0);
  if (n <= 0) return {};
  std::string text(buffer, static_cast<size_t>(n));
  text = text.substr(0, text.find('\n'));
  for (char& c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7f) c = '?';
  }
  return text;
}

bool same_file(int fd, const fs::path& path) {
  struct stat open_st {
  }, path_st{};
  return ::fstat(fd, &open_st) == 0 && ::lstat(path.c_str(), &path_st) == 0 &&
         open_st.st_dev == path_st.st_dev && open_st.st_ino == path_st.st_ino;
}

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);  // best effort: the rename has happened either way
  ::close(fd);
}

// Names in `dir` that are not regular files of the set; empty when it holds only those.
std::string foreign_entry(const fs::path& dir, std::span<const std::string_view> names,
                          std::error_code& ec) {
  for (fs::directory_iterator it(dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool in_set = std::find(names.begin(), names.end(), name) != names.end();
    if (!in_set || !it->is_regular_file(ec) || it->is_symlink(ec)) return name;
  }
  return {};
}

std::string set_list(std::span<const std::string_view> names) {
  std::string list;
  for (std::string_view name : names) list += cat(list.empty() ? "" : ", ", name);
  return list;
}

}  // namespace

void crash_point(std::string_view name) {
  const char* at = std::getenv("E4KV_TEST_CRASH_AT");
  if (at != nullptr && name == at) ::_exit(9);
}

fs::path lock_path_for(const fs::path& output) {
  const fs::path target = normal_target(output);
  return target.parent_path() / cat(".", target.filename().string(), ".lock");
}

Result<OutputLock> OutputLock::acquire(const fs::path& lock_path, const fs::path& output) {
  // A holder that releases removes the file: a lock taken on a file that is no longer (or not
  // yet again) the one at lock_path guards nothing, so open it anew.
  for (int attempt = 0; attempt < 16; ++attempt) {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
      const int error = errno;
      return Status::error(cat(output.string(), ": cannot create the lock file ",
                               lock_path.string(), ": ", errno_message(error)));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return Status::error(cat(output.string(), ": the lock file ", lock_path.string(),
                               " is not a regular file; remove it"));
    }
    int locked = 0;
    do {
      locked = ::flock(fd, LOCK_EX | LOCK_NB);
    } while (locked != 0 && errno == EINTR);
    if (locked != 0) {
      const int error = errno;
      if (error == EWOULDBLOCK) {
        const std::string holder = read_holder(fd);
        ::close(fd);
        return Status::error(cat(output.string(), ": another e4kv is writing it (lock ",
                                 lock_path.string(), " held by ",
                                 holder.empty() ? std::string("another process") : holder,
                                 "); wait for it to finish or choose another output"));
      }
      ::close(fd);
      return Status::error(
          cat(output.string(), ": cannot lock ", lock_path.string(), ": ", errno_message(error)));
    }
    if (!same_file(fd, lock_path)) {
      ::close(fd);
      continue;
    }
    const std::string text = holder_text() + "\n";
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) < 0) {
      // The holder text is only for the messages of others: the lock itself holds.
    }
    return OutputLock(lock_path, fd);
  }
  return Status::error(cat(output.string(), ": cannot take the lock ", lock_path.string(),
                           ": it keeps being replaced"));
}

OutputLock::OutputLock(OutputLock&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

OutputLock& OutputLock::operator=(OutputLock&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

OutputLock::~OutputLock() {
  release();
}

void OutputLock::release() {
  if (fd_ < 0) return;
  // Removed while still held, so nobody can take the old file after us (acquire checks it opened
  // the file that is at the path).
  if (same_file(fd_, path_)) ::unlink(path_.c_str());
  ::close(fd_);
  fd_ = -1;
}

Status check_output_set_dir(const fs::path& dir, std::span<const std::string_view> names,
                            const OutputRules& rules) {
  if (dir.empty()) return Status::error("an empty output path");
  E4KV_RETURN_IF_ERROR(check_not_in_root(dir));
  struct stat st {};
  std::error_code ec;
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || fs::is_empty(dir, ec) || ec) {
    return check_output_dir(dir, rules);
  }
  const std::string foreign = foreign_entry(dir, names, ec);
  if (ec) return Status::error(cat(dir.string(), ": cannot list: ", ec.message()));
  if (!foreign.empty()) {
    return Status::error(cat(dir.string(), ": holds ", foreign, ", which is not one of the files ",
                             set_list(names),
                             " written there as one set; give a new or empty directory"));
  }
  for (std::string_view name : names) {
    const fs::path file = dir / name;
    if (::lstat(file.c_str(), &st) != 0) continue;
    E4KV_RETURN_IF_ERROR(check_output_file(file, rules));
  }
  return ok_status();
}

Status write_output_set_dir(const fs::path& dir, const std::vector<OutputSetFile>& files,
                            bool replace) {
  const fs::path target = normal_target(dir);
  E4KV_ASSIGN_OR_RETURN(const fs::path temp, make_temporary_dir_for(target));
  struct TempGuard {
    fs::path path;
    ~TempGuard() {
      std::error_code ec;
      if (!path.empty()) fs::remove_all(path, ec);
    }
  } guard{temp};
  for (const OutputSetFile& file : files) {
    E4KV_RETURN_IF_ERROR(write_file_atomic(temp / file.name, file.bytes));
  }
  crash_point("before-publish");

  if (::rename(temp.c_str(), target.c_str()) == 0) {
    guard.path.clear();
    sync_directory(target.parent_path());
    return ok_status();
  }
  int error = errno;
  if ((error == ENOTEMPTY || error == EEXIST) && replace) {
    std::vector<std::string_view> names;
    for (const OutputSetFile& file : files) names.push_back(file.name);
    std::error_code ec;
    const std::string foreign = foreign_entry(target, names, ec);
    if (ec || !foreign.empty()) {
      return Status::error(
          cat(dir.string(), ": ",
              ec ? cat("cannot list: ", ec.message()) : cat("holds ", foreign, " by now"),
              "; nothing was replaced, give a new or empty directory"));
    }
    // One step: the old set leaves as the new one arrives. The old one then lies at `temp`, which
    // the guard removes.
    if (::renameat2(AT_FDCWD, temp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      sync_directory(target.parent_path());
      return ok_status();
    }
    error = errno;
    if (error == EINVAL || error == ENOSYS || error == EOPNOTSUPP) {
      // A file system without RENAME_EXCHANGE: the old set moves aside first, so for a moment
      // there is no set at all, but never a mix.
      E4KV_ASSIGN_OR_RETURN(const fs::path aside, make_temporary_dir_for(target));
      if (::rename(target.c_str(), aside.c_str()) == 0) {
        if (::rename(temp.c_str(), target.c_str()) == 0) {
          guard.path = aside;
          sync_directory(target.parent_path());
          return ok_status();
        }
        error = errno;
        (void)::rename(aside.c_str(), target.c_str());
      } else {
        error = errno;
        ::rmdir(aside.c_str());
      }
    }
  }
  return Status::error(cat(dir.string(), ": cannot move ", temp.string(),
                           " into place: ", errno_message(error),
                           error == ENOTEMPTY || error == EEXIST
                               ? " (the directory filled up meanwhile; choose a new directory)"
                               : ""));
}

}  // namespace e4kv
