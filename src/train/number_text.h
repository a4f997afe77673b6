// A double as the shortest text that reads back to the same value, for messages and descriptions
// ("0.05", not "0.050000000000000003"; %.17g keeps short values short only when they are exact).
//
// Thread safety: a pure function.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace shoal::train {

inline std::string number_text(double value) {
  char text[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  return text;
}

}  // namespace shoal::train
