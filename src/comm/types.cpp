#include "shoal/comm/types.h"

#include <cstdlib>
#include <string>

#include "shoal/error.h"

namespace shoal::comm {

Milliseconds timeout_from_env(Milliseconds fallback) {
  const char* raw = std::getenv("SHOAL_TIMEOUT");
  if (raw == nullptr || *raw == '\0') return fallback;
  std::string text(raw);
  double scale = 1.0;
  std::string number = text;
  if (text.size() > 2 && text.compare(text.size() - 2, 2, "ms") == 0) {
    number = text.substr(0, text.size() - 2);
  } else if (text.size() > 1 && text.back() == 's') {
    number = text.substr(0, text.size() - 1);
    scale = 1000.0;
  }
  char* end = nullptr;
  double value = std::strtod(number.c_str(), &end);
  SHOAL_CHECK_T(InvalidArgument, end != number.c_str() && *end == '\0' && value > 0,
                "SHOAL_TIMEOUT='", text,
                "' is not a positive duration; use milliseconds (30000) or seconds (30s)");
  return Milliseconds(static_cast<int64_t>(value * scale));
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "unknown";
}

}  // namespace shoal::comm
