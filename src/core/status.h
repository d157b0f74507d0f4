// Errors in three tiers (STYLE.md): bad user input returns a Status / Result<T> whose message names
// the file, key or flag and says what to do; broken invariants use E4KV_ASSERT (check.h); CUDA
// calls go through E4KV_CUDA_CHECK (backend/cuda).
#pragma once

#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <variant>

#include "core/check.h"

namespace e4kv {

// Concatenates any streamable values into one string: cat("layer ", i, ": ", msg).
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status error(std::string message) { return Status(std::move(message)); }
  // An error about one option of a call, named as the library names it (the options struct's
  // field, snake_case: "top_p"): the message reads "top_p: <detail>". Library messages never name
  // a front end's spelling; a front end that has its own (the CLI's --top-p) rewrites the prefix
  // from option() and detail().
  static Status option_error(std::string option, const std::string& detail) {
    Status status(cat(option, ": ", detail));
    status.option_ = std::move(option);
    return status;
  }

  bool ok() const { return !message_.has_value(); }
  // Empty for an ok status.
  const std::string& message() const {
    static const std::string kEmpty;
    return message_ ? *message_ : kEmpty;
  }
  // The option an option_error is about; empty for other statuses.
  const std::string& option() const { return option_; }
  // The message without its "option: " prefix (the whole message for other statuses).
  std::string detail() const {
    return option_.empty() ? message() : message().substr(option_.size() + 2);
  }

 private:
  explicit Status(std::string message) : message_(std::move(message)) {}
  std::optional<std::string> message_;
  std::string option_;
};

inline Status ok_status() {
  return Status();
}

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : state_(std::move(status)) {  // NOLINT: implicit by design
    E4KV_ASSERT(!std::get<Status>(state_).ok(), "Result built from an ok Status carries no value");
  }

  bool ok() const { return std::holds_alternative<T>(state_); }
  Status status() const { return ok() ? Status() : std::get<Status>(state_); }
  const std::string& message() const {
    static const std::string kEmpty;
    return ok() ? kEmpty : std::get<Status>(state_).message();
  }

  T& value() & {
    E4KV_ASSERT(ok(), "value() on an error Result: " + message());
    return std::get<T>(state_);
  }
  const T& value() const& {
    E4KV_ASSERT(ok(), "value() on an error Result: " + message());
    return std::get<T>(state_);
  }
  T&& value() && {
    E4KV_ASSERT(ok(), "value() on an error Result: " + message());
    return std::get<T>(std::move(state_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> state_;
};

}  // namespace e4kv

#define E4KV_CONCAT_INNER_(a, b) a##b
#define E4KV_CONCAT_(a, b) E4KV_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function when `expr` (a Status) is an error.
#define E4KV_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::e4kv::Status e4kv_status_ = (expr);        \
    if (!e4kv_status_.ok()) return e4kv_status_; \
  } while (0)

// `E4KV_ASSIGN_OR_RETURN(auto x, f());` binds the value or returns the error.
#define E4KV_ASSIGN_OR_RETURN(lhs, expr) \
  E4KV_ASSIGN_OR_RETURN_IMPL_(E4KV_CONCAT_(e4kv_result_, __LINE__), lhs, expr)
#define E4KV_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
