// The names of a closed choice of TrainOptions (the optimizer, the precision, ...), kept in one
// array in the enum's order, so that parsing a name and printing a value read the same list.
//
// Thread safety: pure functions over constant arrays.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "shoal/error.h"

namespace shoal::train::detail {

/// "a, b or c": the names as a message lists them.
template <size_t N>
std::string choice_list(const char* const (&names)[N]) {
  std::string text;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) text += i + 1 == N ? " or " : ", ";
    text += names[i];
  }
  return text;
}

/// The value `name` names; InvalidArgument "<what> must be a, b or c, got '<name>'" otherwise.
template <typename Enum, size_t N>
Enum parse_choice(const char* const (&names)[N], const std::string& name, const char* what) {
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<Enum>(i);
  }
  SHOAL_THROW(InvalidArgument, what, " must be ", choice_list(names), ", got '", name, "'");
}

/// The name of `value`.
template <typename Enum, size_t N>
const char* choice_name(const char* const (&names)[N], Enum value) {
  const auto index = static_cast<size_t>(value);
  SHOAL_CHECK_T(InvalidArgument, index < N, "no name for choice ", index);
  return names[index];
}

/// Every name, in the enum's order.
template <size_t N>
std::vector<std::string> choice_names(const char* const (&names)[N]) {
  return {names, names + N};
}

}  // namespace shoal::train::detail
