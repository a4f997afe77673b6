// WorkerSpec: everything needed to start one worker process, decided before any is started.
//
// Thread safety: a plain value.
#pragma once

#include <string>
#include <vector>

namespace shoal::launcher {

struct WorkerSpec {
  std::string role = "worker";
  int rank = 0;                    ///< global rank (RANK)
  std::string label;               ///< "rank 3": names the worker in prefixes and messages
  std::string program;             ///< resolved path of the program
  std::vector<std::string> argv;   ///< argv[0] is the program as the user wrote it
  std::vector<std::string> env;    ///< complete environment, "NAME=value"
  /// torchrun's --redirects/--tee: each stream's log file ("" for none), and whether the stream
  /// also reaches the launcher's console (false: redirected to the file only).
  std::string stdout_file;
  std::string stderr_file;
  bool stdout_to_console = true;
  bool stderr_to_console = true;
  /// Where the worker leaves its error if it fails (TORCHELASTIC_ERROR_FILE; log/error_file.h).
  std::string error_file;
};

}  // namespace shoal::launcher
