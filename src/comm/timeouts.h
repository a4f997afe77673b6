// How long the communication layer waits, and for what (private to the library).
//
// A peer that is alive but slow (rank 0 evaluating or saving a checkpoint, a straggler) is waited
// for kJobTimeout by init_process_group's groups; a dead one is not waited for at all (a peer that
// exits or closes its connections fails the operation at once), and a peer stopped on this host
// (SIGSTOP, Ctrl-Z, a debugger) fails it within kStoppedPeerTimeout.
#pragma once

#include "shoal/comm/types.h"

namespace shoal::comm {

/// init_process_group's default time-out (SHOAL_TIMEOUT or InitOptions::timeout override it).
/// PyTorch waits 30 min; 10 min still frees a hung job's machine reasonably soon.
constexpr Milliseconds kJobTimeout{600'000};

/// How long a peer on this host may stay stopped while another rank waits for it.
constexpr Milliseconds kStoppedPeerTimeout{5'000};

/// Appended to every time-out message: how to wait longer.
constexpr const char* kTimeoutHint =
    " (to wait longer, set SHOAL_TIMEOUT, e.g. SHOAL_TIMEOUT=1800s, or InitOptions::timeout)";

}  // namespace shoal::comm
