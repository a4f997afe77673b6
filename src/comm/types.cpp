#include "shoal/comm/types.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "comm/timeouts.h"
#include "shoal/env.h"
#include "shoal/error.h"

namespace shoal::comm {

Milliseconds timeout_from_env(Milliseconds fallback) {
  return env::duration(env::Var::kTimeout).value_or(fallback);
}

Milliseconds silent_peer_timeout() {
  // Read at each long wait, not cached: a process may set it after its first group.
  return env::duration(env::Var::kHeartbeatTimeout).value_or(kSilentPeerTimeout);
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
