// Shoal's exceptions and the SHOAL_CHECK macro.
//
// Every error Shoal raises derives from shoal::Error, so callers can catch one type. The message
// says who and what ("[rank 1/4] allreduce #12 ... timed out after 30000 ms waiting for rank 3");
// the source location is kept apart (location()) so that messages shown to users stay one line.
//
// Thread safety: exception objects are immutable after construction.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace shoal {

/// Base of every exception Shoal throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, std::string location = {})
      : std::runtime_error(message), location_(std::move(location)) {}
  /// "file:line" where the error was raised, or empty.
  const std::string& location() const { return location_; }

 private:
  std::string location_;
};

/// A wait ran past its deadline (collective, store, connection).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// A peer died, closed its connection or disagreed on what to do.
class PeerError : public Error {
 public:
  using Error::Error;
};

/// A caller passed something that cannot work; the message says what to do instead.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A checkpoint file is missing, truncated, corrupt or does not match the model.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// A data file is missing, truncated or corrupt.
class DataError : public Error {
 public:
  using Error::Error;
};

namespace detail {

// Appends one piece. Strings and integers are appended directly, without the locale and state of a
// std::ostringstream, which costs more than the text; anything else goes through a stream.
inline void append_piece(std::string& out, const std::string& piece) { out += piece; }
inline void append_piece(std::string& out, const char* piece) { out += piece; }
inline void append_piece(std::string& out, char piece) { out += piece; }
template <typename T>
void append_piece(std::string& out, const T& piece) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    out += std::to_string(piece);
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(piece);
  } else {
    std::ostringstream stream;
    stream << piece;
    out += stream.str();
  }
}

template <typename... Args>
std::string str_cat(Args&&... args) {
  std::string out;
  (append_piece(out, std::forward<Args>(args)), ...);
  return out;
}

template <typename E>
[[noreturn]] void throw_at(const char* file, int line, std::string message) {
  throw E(message, str_cat(file, ":", line));
}

}  // namespace detail
}  // namespace shoal

/// Throws shoal::Error with the concatenated message unless `cond` holds.
#define SHOAL_CHECK(cond, ...) SHOAL_CHECK_T(::shoal::Error, cond, __VA_ARGS__)

/// Throws the given shoal::Error subclass with the concatenated message unless `cond` holds.
#define SHOAL_CHECK_T(type, cond, ...)                                                  \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      ::shoal::detail::throw_at<type>(__FILE__, __LINE__,                               \
                                      ::shoal::detail::str_cat(__VA_ARGS__));           \
    }                                                                                   \
  } while (0)

/// Throws the given shoal::Error subclass with the concatenated message.
#define SHOAL_THROW(type, ...) \
  ::shoal::detail::throw_at<type>(__FILE__, __LINE__, ::shoal::detail::str_cat(__VA_ARGS__))
