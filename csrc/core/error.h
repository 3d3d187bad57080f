// Two error tiers (c10 util/Exception.h): PYDFLASH_CHECK_* for user errors, which the
// binding layer turns into the matching Python exception, and PYDFLASH_INTERNAL_ASSERT
// for bugs in pydflash itself.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pydflash {

/// Base of every error below, so one catch can recognise them all. Single
/// inheritance throughout: each type is a std::runtime_error.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Bad argument value: becomes ValueError.
struct ValueError : Error {
  using Error::Error;
};
/// Argument of the wrong kind: becomes TypeError.
struct TypeError : Error {
  using Error::Error;
};
/// Wrong state (shut down, forked, ...): becomes RuntimeError.
struct StateError : Error {
  using Error::Error;
};
/// A wait ran past its timeout: becomes TimeoutError.
struct TimeoutError : Error {
  using Error::Error;
};
/// A queued task was cancelled: becomes concurrent.futures.CancelledError.
struct CancelledError : Error {
  using Error::Error;
};
/// A CUDA runtime call failed: becomes pydflash.CudaError.
struct CudaError : Error {
  using Error::Error;
};
/// A pydflash bug: becomes pydflash.InternalError.
struct InternalError : Error {
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace pydflash

#define PYDFLASH_CHECK_TYPED(type, cond, ...)                       \
  do {                                                              \
    if (!(cond)) throw ::pydflash::type(::pydflash::detail::str(__VA_ARGS__)); \
  } while (0)
#define PYDFLASH_CHECK_VALUE(cond, ...) PYDFLASH_CHECK_TYPED(ValueError, cond, __VA_ARGS__)
#define PYDFLASH_CHECK_TYPE(cond, ...) PYDFLASH_CHECK_TYPED(TypeError, cond, __VA_ARGS__)
#define PYDFLASH_CHECK_STATE(cond, ...) PYDFLASH_CHECK_TYPED(StateError, cond, __VA_ARGS__)
#define PYDFLASH_INTERNAL_ASSERT(cond)                                                   \
  do {                                                                                   \
    if (!(cond))                                                                         \
      throw ::pydflash::InternalError(::pydflash::detail::str(                          \
          "pydflash internal assert failed: ", #cond, " at ", __FILE__, ":", __LINE__, \
          "; please report a bug"));                                                     \
  } while (0)
