#include "shoal/comm/types.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "comm/timeouts.h"
#include "shoal/error.h"

namespace shoal::comm {

Milliseconds duration_from_env(const char* name, Milliseconds fallback) {
  const char* raw = std::getenv(name);
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
                name, "='", text,
                "' is not a positive duration; use milliseconds (30000) or seconds (30s)");
  return Milliseconds(static_cast<int64_t>(value * scale));
}

Milliseconds timeout_from_env(Milliseconds fallback) {
  return duration_from_env("SHOAL_TIMEOUT", fallback);
}

Milliseconds silent_peer_timeout() {
  // Read at each long wait, not cached: a process may set it after its first group.
  return duration_from_env("SHOAL_HEARTBEAT_TIMEOUT", kSilentPeerTimeout);
}

Milliseconds stopped_peer_timeout() { return std::min(kStoppedPeerTimeout, silent_peer_timeout()); }

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
