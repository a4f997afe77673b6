// The shared multi-rank test harness: a function run as N ranks on N threads of this process, or
// as N forked processes, with deadlines, collected errors and children killed and reaped on exit.
//
// Thread safety: call the runners from the test's main thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "testing/dependencies.h"

namespace shoal::testing {

using Milliseconds = std::chrono::milliseconds;

/// Runs fn(rank) on `world_size` threads. Rethrows the first error (prefixed with the rank).
/// A thread still running at `deadline` fails the test program at once (a hang is a failure).
void run_threads(int world_size, const std::function<void(int rank)>& fn,
                 Milliseconds deadline = Milliseconds(120'000));

/// What became of one forked rank.
struct ProcessResult {
  int rank = 0;
  int exit_code = -1;     ///< exit status, or -1 when killed by a signal
  int signal = 0;         ///< the signal that ended it, or 0
  std::string error;      ///< what() of the exception that ended it, if any
  double seconds = 0;     ///< how long after the start it ended
  bool ok() const { return exit_code == 0 && signal == 0; }
};

/// A forked child that is killed (SIGKILL) and reaped when the object goes away.
class ChildProcess {
 public:
  /// Forks and runs `fn` in the child; the child exits 0 when fn returns, 1 when it throws
  /// (writing what() to the error pipe).
  explicit ChildProcess(const std::function<void()>& fn);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  /// Waits up to `timeout` for the child; returns false (child still running) on time-out.
  bool wait(Milliseconds timeout);
  void kill(int signal = 9);
  /// Valid after wait() returned true.
  const ProcessResult& result() const { return result_; }

 private:
  pid_t pid_ = -1;
  int error_fd_ = -1;
  bool reaped_ = false;
  ProcessResult result_;
  std::chrono::steady_clock::time_point start_;
};

/// Runs fn(rank, store_path) as `world_size` forked processes that can meet through a file store
/// at store_path (and signal each other with files "<store_path>.<what>", removed at the end). Returns each rank's result; processes still running at `deadline` are killed
/// (their result says signal 9).
std::vector<ProcessResult> run_processes(int world_size,
                                         const std::function<void(int rank,
                                                                  const std::string& store_path)>& fn,
                                         Milliseconds deadline = Milliseconds(120'000));

/// How long the gloo and mpi backends spend naming the peer at fault after a time-out or a peer
/// error (their kDiagnoseBudget), before the error reaches the caller.
constexpr Milliseconds kDiagnoseBudget{2000};

/// Slack for a loaded 2-core machine (process start-up, scheduling) in every fault-time bound.
constexpr Milliseconds kLoadMargin{3000};

/// The latest, in seconds, an operation with time-out `timeout` may report a fault: the time-out,
/// the diagnosis budget and kLoadMargin.
inline double fault_deadline_seconds(Milliseconds timeout) {
  return static_cast<double>((timeout + kDiagnoseBudget + kLoadMargin).count()) / 1000.0;
}

/// Creates the empty file `path`: a signal from one process (or thread) of a test to another.
void touch_file(const std::string& path);

/// Waits until `condition()` holds (polled every few milliseconds); false when `timeout` passed
/// first. How a test waits for another thread or process to have done something: on the thing
/// itself, with a deadline, never on a sleep that assumes it has been scheduled by then.
bool wait_until(const std::function<bool()>& condition, Milliseconds timeout);

/// Waits until every file of `paths` exists; false when `timeout` passed first. A handshake in
/// place of a sleep: the waiter goes on exactly when the other side has done what it waits for.
bool wait_for_files(const std::vector<std::string>& paths, Milliseconds timeout);

/// wait_for_files for one file.
inline bool wait_for_file(const std::string& path, Milliseconds timeout) {
  return wait_for_files({path}, timeout);
}

/// A fresh path under the temporary folder, unique to this process and call.
std::string temp_path(const std::string& stem);

/// The whole content of the file `path`, or "" when it cannot be read (say, a command's captured
/// output that was never written).
std::string read_file(const std::string& path);

/// Exit code CTest treats as "skipped" (SKIP_RETURN_CODE).
constexpr int kSkipExitCode = 77;

/// Ends the whole program for want of `dependency`: exit kSkipExitCode (reported as skipped) when
/// nothing has failed so far and the skip is allowed here (see dependencies.h), else exit 1 with
/// why. Prefer SHOAL_SKIP_TEST, which skips one test; this is for main() before any test runs.
[[noreturn]] void skip_program(Dependency dependency, const std::string& reason);

/// skip_program for a required dependency (a failure under SHOAL_REQUIRE_ORACLES=1).
[[noreturn]] void skip_program(const std::string& reason);

/// A free TCP port on the loopback interface (bound and released).
int free_port();

}  // namespace shoal::testing
