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

/// How long a peer's heartbeat (every kHangPollInterval, from a thread of its own) may stand
/// still while another rank waits for it in a Gloo operation before it is presumed stopped or cut
/// off: the heartbeat finds stopped peers on other hosts, where the kernel's process state cannot
/// be read. A peer that is slow but alive keeps beating and is waited for. Why 10 s: twenty
/// missed beats, beyond any scheduling delay of a loaded machine. SHOAL_HEARTBEAT_TIMEOUT
/// changes it.
constexpr Milliseconds kSilentPeerTimeout{10'000};

/// How long a failed or timed-out operation waits for the other ranks to report the same failure,
/// so that the silent one can be named (at most half the operation's time-out where it is short).
/// Short: the error must arrive within about the time-out.
constexpr Milliseconds kDiagnoseBudget{2'000};

/// SHOAL_HEARTBEAT_TIMEOUT (as SHOAL_TIMEOUT: 10000, 10s, 500ms), else kSilentPeerTimeout.
Milliseconds silent_peer_timeout();

/// How long a peer on this host may stay stopped: kStoppedPeerTimeout, or SHOAL_HEARTBEAT_TIMEOUT
/// when that is shorter (a stopped peer is named within it on every backend).
Milliseconds stopped_peer_timeout();

/// Appended to every time-out message: how to wait longer.
constexpr const char* kTimeoutHint =
    " (to wait longer, set SHOAL_TIMEOUT, e.g. SHOAL_TIMEOUT=1800s, or InitOptions::timeout)";

}  // namespace shoal::comm
