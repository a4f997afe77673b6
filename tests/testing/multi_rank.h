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
/// at store_path. Returns each rank's result; processes still running at `deadline` are killed
/// (their result says signal 9).
std::vector<ProcessResult> run_processes(int world_size,
                                         const std::function<void(int rank,
                                                                  const std::string& store_path)>& fn,
                                         Milliseconds deadline = Milliseconds(120'000));

/// A fresh path under the temporary folder, unique to this process and call.
std::string temp_path(const std::string& stem);

/// Exit code CTest treats as "skipped" (SKIP_RETURN_CODE).
constexpr int kSkipExitCode = 77;

/// Prints why and exits with kSkipExitCode: the whole test program is reported as skipped.
[[noreturn]] void skip_program(const std::string& reason);

/// A free TCP port on the loopback interface (bound and released).
int free_port();

}  // namespace shoal::testing
