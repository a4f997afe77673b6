// How a process ended, and how the launcher reports it.
//
// Thread safety: a plain value.
#pragma once

#include <string>

namespace shoal::launcher {

struct ExitStatus {
  int code = 0;    ///< exit status when the process exited
  int signal = 0;  ///< the signal that killed it, or 0

  /// Decodes a waitpid() status.
  static ExitStatus from_wait_status(int status);
  bool ok() const { return signal == 0 && code == 0; }
  /// The shell's convention: the exit status, or 128 + the signal number.
  int shell_code() const { return signal != 0 ? 128 + signal : code; }
  /// "exited with status 3", "was killed by signal 9 (SIGKILL)".
  std::string describe() const;
};

/// "SIGTERM", or "signal 42" for a signal without a usual name.
std::string signal_name(int signal);

}  // namespace shoal::launcher
