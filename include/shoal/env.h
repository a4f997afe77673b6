// The environment variables Shoal reads: one table (each variable's name, the values it takes, its
// default and what it does) and the readers that parse and check them. Every read of one of these
// variables goes through a reader here, so a value out of range fails the same way everywhere: one
// line, InvalidArgument, naming the variable and what it accepts. `shoal env` prints the table and
// docs/GUIDE.md copies it (a test compares the two).
//
// The launchers' own variables (RANK, WORLD_SIZE, MASTER_ADDR, OMPI_*, SLURM_*, PMI_*) are not
// here: they mean what torchrun, OpenMPI and SLURM say, and detect_rank_info (shoal/comm/init.h)
// parses them, in one place.
//
//   if (env::flag(env::Var::kLaunchExec)) ...;
//   const auto spin = env::integer(env::Var::kShmSpinUs);  // std::nullopt when unset
//
// Thread safety: the table is immutable. The readers call std::getenv on every call (a value set
// with setenv is seen by the next read) and are as thread-safe as getenv: safe unless another
// thread changes the environment at the same time.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shoal::env {

/// Every variable of the table, in its order.
enum class Var {
  kLogLevel,
  kTimeout,
  kHeartbeatTimeout,
  kDebug,
  kCheckCollectives,
  kBackend,
  kAuthToken,
  kHostname,
  kSigusr1,
  kSigusr1Ignored,
  kGlooReduceScatter,
  kAllreduceAlgo,
  kShmChunkBytes,
  kShmInlineBytes,
  kShmSymmetricMinBytes,
  kShmSpinUs,
  kTuneMalloc,
  kLaunchExec,
  kPsNumServers,
  kPsNumWorkers,
  kPsHost,
  kSourceDir,
  kRestartCount,
  kGlooSocketIfname,
  kFtAgentStore,
  kFtSampleLog,
};

/// How a variable's value is read.
enum class Kind {
  kText,      ///< any non-empty text
  kFlag,      ///< 0 or 1 (also false or true)
  kInteger,   ///< a decimal integer from `min` to `max`
  kDuration,  ///< milliseconds (30000, 500ms) or seconds (30s, 1.5s), more than 0
  kChoice,    ///< one of `values` (separated by '|'), in any case
};

/// One row of the table.
struct Variable {
  Var var;
  const char* name;
  Kind kind;
  /// kChoice: the choices, "off|info|detail"; other kinds: what a value looks like, for the docs.
  const char* values;
  /// When unset: the value, or what happens ("the machine's host name").
  const char* default_value;
  /// What it does, one sentence.
  const char* meaning;
  int64_t min = 0;  ///< kInteger only
  int64_t max = 0;  ///< kInteger only
};

/// The whole table, in the order of Var.
const std::vector<Variable>& variables();

/// The row of `var`.
const Variable& describe(Var var);

/// The value as set; std::nullopt when unset or empty. No check beyond that (kText).
std::optional<std::string> text(Var var);

/// A kFlag variable: std::nullopt when unset or empty. Throws InvalidArgument for another value.
std::optional<bool> flag_if_set(Var var);

/// A kFlag variable, or its default (the table's) when unset.
bool flag(Var var);

/// A kInteger variable, checked against the table's range; std::nullopt when unset or empty.
std::optional<int64_t> integer(Var var);

/// A kDuration variable; std::nullopt when unset or empty.
std::optional<std::chrono::milliseconds> duration(Var var);

/// A kChoice variable, in lower case, or its default when unset; throws for another value.
std::string choice(Var var);

/// The table as `shoal env` prints it: one paragraph per variable.
std::string listing();

/// The table as a Markdown table (the one docs/GUIDE.md holds).
std::string markdown_table();

}  // namespace shoal::env
