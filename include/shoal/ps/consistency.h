// The parameter server's consistency models.
//
//   kBsp  bulk synchronous: a server waits for every worker's gradient of a step and applies
//         their mean once; a pull after step t returns the parameters after step t (DDP's math).
//   kAsp  asynchronous: each push is applied on arrival, as 1/W of a step (W pushes move the
//         weights as far as one bsp step); a pull returns the latest parameters.
//   kSsp  stale synchronous with bound s (Ho et al., NIPS 2013): pushes are applied on arrival,
//         and a worker that has finished clock c may start clock c + 1 only while the slowest
//         live worker has finished at least c + 1 - s clocks; pushes are applied as under asp.
//         s = 0 waits like bsp but applies each push on arrival.
//
// Thread safety: plain values and pure functions.
#pragma once

#include <string>

namespace shoal::ps {

enum class Consistency { kBsp, kAsp, kSsp };

/// "bsp", "asp", "ssp".
const char* consistency_name(Consistency consistency);

/// Parses "bsp" / "asp" / "ssp"; throws InvalidArgument for anything else.
Consistency parse_consistency(const std::string& name);

}  // namespace shoal::ps
