// One typed exception for the whole tool: libraries throw, main
// catches once and maps the kind to an exit status.
#pragma once

#include <stdexcept>
#include <string>

#include "parallel_errors.h"  // OutOfMemory

namespace moev {

enum class ErrorKind { bad_input, runtime, not_supported /* a requested path this build cannot run: exit 5 */ };

struct Error : std::runtime_error {
  ErrorKind kind;
  Error(ErrorKind k, const std::string& msg) : std::runtime_error(msg), kind(k) {}
};

[[noreturn]] inline void bad_input(const std::string& msg) { throw Error(ErrorKind::bad_input, msg); }
[[noreturn]] inline void runtime_error(const std::string& msg) { throw Error(ErrorKind::runtime, msg); }
}  // namespace moev
