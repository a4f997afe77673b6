// What every process group of this process was doing, for hung jobs: each group keeps its last
// operations (ProcessGroup::recent_operations), and SIGUSR1 prints them all to stderr, as
// faulthandler or py-spy would for a Python job:
//
//   kill -USR1 <pid>     # [rank 1/2] allreduce #57 (4.0 MB float32, sum): in flight for 31.2 s
//
// init_process_group installs the SIGUSR1 handler (SHOAL_SIGUSR1=0 leaves it out, and a handler
// the program set first is kept); the dump itself runs on a thread of its own, not in the handler.
//
// `shoal run` passes SIGUSR1 on to its workers (kill -USR1 <launcher pid> dumps every rank). Its
// workers start with SIGUSR1 ignored, so that one which has not installed the handler (yet, or
// ever: a shell script, a program without Shoal) is not killed by it; SHOAL_SIGUSR1_IGNORED=1 in
// their environment lets the handler replace that ignore.
//
// Thread safety: every function may be called from any thread.
#pragma once

#include <cstdio>

namespace shoal::comm {

class ProcessGroup;

/// Writes every live group's recent operations to `out`, a block per group.
void dump_recent_operations(std::FILE* out = stderr);

/// Set by `shoal run` in its workers' environment: their SIGUSR1 is ignored by the launcher's
/// choice, and install_dump_on_sigusr1() may replace the ignore.
constexpr const char* kSigusr1IgnoredEnv = "SHOAL_SIGUSR1_IGNORED";

/// From now on SIGUSR1 makes this process write dump_recent_operations() to stderr. Idempotent;
/// does nothing when SHOAL_SIGUSR1=0 or when SIGUSR1 already has a handler or is ignored (unless
/// SHOAL_SIGUSR1_IGNORED=1 says the ignore is `shoal run`'s).
void install_dump_on_sigusr1();

/// Called by ProcessGroup's constructor and destructor (not for users).
void register_process_group(ProcessGroup* group);
void unregister_process_group(ProcessGroup* group);

}  // namespace shoal::comm
