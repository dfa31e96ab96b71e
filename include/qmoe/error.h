// qmoe::Error — the one exception type the library throws.
//
// Every check names the argument, what was expected and what was given, so a user reads
// e.g. "qmoe: argument 'topk_ids': expected dtype int32 or int64, got float32".
// kind() tells the Python binding which exception to raise (TypeError for dtypes,
// ValueError for everything else). The library never calls exit().
#pragma once

#include <stdexcept>
#include <string>

namespace qmoe {

enum class ErrorKind { kValue, kType, kRuntime };

class Error : public std::runtime_error {
 public:
  Error(std::string argument, std::string expected, std::string got, ErrorKind kind = ErrorKind::kValue)
      : std::runtime_error(format(argument, expected, got)),
        argument_(std::move(argument)), expected_(std::move(expected)), got_(std::move(got)), kind_(kind) {}

  const std::string& argument() const { return argument_; }
  const std::string& expected() const { return expected_; }
  const std::string& got() const { return got_; }
  ErrorKind kind() const { return kind_; }

 private:
  static std::string format(const std::string& argument, const std::string& expected, const std::string& got) {
    return "qmoe: argument '" + argument + "': expected " + expected + ", got " + got;
  }
  std::string argument_, expected_, got_;
  ErrorKind kind_;
};

// Throws qmoe::Error(argument, expected, got) when cond is false.
inline void check_arg(bool cond, const std::string& argument, const std::string& expected, const std::string& got,
                      ErrorKind kind = ErrorKind::kValue) {
  if (!cond) throw Error(argument, expected, got, kind);
}

}  // namespace qmoe

// check_arg with lazy messages: the argument, expected and got expressions (and the optional kind) are
// evaluated only when cond is false. Validation runs on every call, and building the message strings
// of checks that pass cost ~30 us per fused_moe call; the hot validation paths use this form.
#define QMOE_CHECK_ARG(cond, ...)                               \
  do {                                                          \
    if (!(cond)) throw ::qmoe::Error(__VA_ARGS__);              \
  } while (0)
