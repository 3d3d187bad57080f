// Two error tiers (c10 util/Exception.h): PYDFLASH_CHECK_* for user errors, which the
// binding layer turns into the matching Python exception, and PYDFLASH_INTERNAL_ASSERT
// for bugs in pydflash itself.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

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
/// A task's input failed or was cancelled: becomes pydflash.InputFailedError.
struct InputError : StateError {
  using StateError::StateError;
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

// Note [No iostreams in error messages]: messages are built with std::string and
// snprintf, not std::ostringstream. On the GPU host a process that had loaded another
// libstdc++ crashed whenever a binding formatted a number into a stream; messages
// made only of strings did not.
inline void append(std::string& out, const std::string& value) { out += value; }
inline void append(std::string& out, const char* value) { out += value; }
inline void append(std::string& out, char value) { out += value; }
inline void append(std::string& out, bool value) { out += value ? "true" : "false"; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
void append(std::string& out, T value) {
  char buffer[32];
  if constexpr (std::is_floating_point_v<T>) {
    std::snprintf(buffer, sizeof(buffer), "%g", static_cast<double>(value));
  } else if constexpr (std::is_signed_v<T>) {
    std::snprintf(buffer, sizeof(buffer), "%lld", static_cast<long long>(value));
  } else {
    std::snprintf(buffer, sizeof(buffer), "%llu", static_cast<unsigned long long>(value));
  }
  out += buffer;
}

template <typename... Args>
std::string str(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

}  // namespace detail

}  // namespace pydflash

#define PYDFLASH_CHECK_TYPED(type, cond, ...)                                  \
  do {                                                                         \
    if (!(cond)) throw ::pydflash::type(::pydflash::detail::str(__VA_ARGS__)); \
  } while (0)
#define PYDFLASH_CHECK_VALUE(cond, ...) PYDFLASH_CHECK_TYPED(ValueError, cond, __VA_ARGS__)
#define PYDFLASH_CHECK_TYPE(cond, ...) PYDFLASH_CHECK_TYPED(TypeError, cond, __VA_ARGS__)
#define PYDFLASH_CHECK_STATE(cond, ...) PYDFLASH_CHECK_TYPED(StateError, cond, __VA_ARGS__)
#define PYDFLASH_INTERNAL_ASSERT(cond)                                                          \
  do {                                                                                          \
    if (!(cond))                                                                                \
      throw ::pydflash::InternalError(                                                          \
          ::pydflash::detail::str("pydflash internal assert failed: ", #cond, " at ", __FILE__, \
                                  ":", __LINE__, "; please report a bug"));                     \
  } while (0)
