// moekit::Status: the error type of the whole public API. No function of the API throws; each
// returns a Status that is either ok or names the op, the argument and the offending value.
#pragma once

#include <string>
#include <utility>

namespace moekit {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller passed something the op does not accept
  kUnimplemented,    // a valid combination that no backend implements (e.g. a dtype on a backend)
  kInternal,         // a library underneath failed (oneDNN, CUDA); the message says which
};

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok

  // "op: argument = value: what is wrong", e.g.
  // "ragged_dot: group_sizes[3] = -2: group sizes must be >= 0".
  static Status invalid_argument(std::string op, std::string argument, std::string value,
                                 std::string what) {
    return Status(StatusCode::kInvalidArgument, std::move(op), std::move(argument),
                  std::move(value), std::move(what));
  }
  static Status unimplemented(std::string op, std::string what) {
    return Status(StatusCode::kUnimplemented, std::move(op), "", "", std::move(what));
  }
  static Status internal(std::string op, std::string what) {
    return Status(StatusCode::kInternal, std::move(op), "", "", std::move(what));
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& op() const { return op_; }
  const std::string& argument() const { return argument_; }  // empty unless invalid_argument
  const std::string& value() const { return value_; }
  const std::string& what() const { return what_; }        // what is wrong, alone
  const std::string& message() const { return message_; }  // the full sentence

 private:
  Status(StatusCode code, std::string op, std::string argument, std::string value, std::string what)
      : code_(code),
        op_(std::move(op)),
        argument_(std::move(argument)),
        value_(std::move(value)),
        what_(std::move(what)) {
    message_ = op_ + ": ";
    if (!argument_.empty()) message_ += argument_ + " = " + value_ + ": ";
    message_ += what_;
  }

  StatusCode code_ = StatusCode::kOk;
  std::string op_, argument_, value_, what_, message_;
};

}  // namespace moekit

// Returns the Status of `expr` from the enclosing function when it is not ok.
#define MOEKIT_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::moekit::Status moekit_status_ = (expr);        \
    if (!moekit_status_.ok()) return moekit_status_; \
  } while (0)
