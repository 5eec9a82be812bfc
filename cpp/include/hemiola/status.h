// Errors. Inside the engine failures are C++ exceptions of type hemiola::Error
// carrying a code and a message that starts with the file:line that raised it.
// The Python module maps codes to Python exception types.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "hemiola/export.h"

namespace hemiola {

enum class ErrorCode : int {
  kInvalidArgument = 1,  // the caller passed something the engine cannot use
  kTimeout = 2,          // a collective or rendezvous did not complete in time
  kCommFailure = 3,      // the transport failed (a peer died, a socket broke)
  kAborted = 4,          // the operation was cancelled (see the message for why)
  kInternal = 5,         // a bug in hemiola
  kNotFinite = 6,        // a value that must be finite holds NaN or infinity
};

class HEMIOLA_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

HEMIOLA_API const char* error_code_name(ErrorCode code);

namespace detail {
[[noreturn]] HEMIOLA_API void throw_error(ErrorCode code, const char* file, int line,
                                         const std::string& message);

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace hemiola

// Throw hemiola::Error(code, "file:line: message...").
#define HEMIOLA_THROW(code, ...) \
  ::hemiola::detail::throw_error(code, __FILE__, __LINE__, ::hemiola::detail::concat(__VA_ARGS__))

// Argument check: throws kInvalidArgument with the message when cond is false.
#define HEMIOLA_CHECK(cond, ...)                                                   \
  do {                                                                             \
    if (!(cond)) HEMIOLA_THROW(::hemiola::ErrorCode::kInvalidArgument, __VA_ARGS__); \
  } while (0)
