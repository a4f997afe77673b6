// WorkerProcess: one worker, started with fork+exec in a process group of its own (or with fork
// alone when the worker is this program and set_self_entry() gave its main: launch.h).
//
// The worker's group lets the launcher signal the worker together with whatever it started
// (a shell script's children, a Python worker's data loaders). Its stdin is /dev/null (a
// background process group reading the terminal would be stopped); its stdout and stderr are
// either inherited or captured through pipes for the launcher to prefix.
//
// Thread safety: not thread-safe; the launcher's monitoring loop owns it. The destructor kills
// (SIGKILL to the group) and reaps a worker that is still running, so no zombie is left behind.
#pragma once

#include <sys/types.h>

#include <chrono>

#include "launcher/exit_status.h"
#include "launcher/worker_spec.h"

namespace shoal::launcher {

class WorkerProcess {
 public:
  /// Why 10 s: exec of a present program takes milliseconds; this bounds a wedged file system.
  static constexpr std::chrono::milliseconds kExecTimeout{10'000};

  WorkerProcess(WorkerSpec spec, bool capture_output);
  ~WorkerProcess();
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  /// Forks and execs; returns once the program runs. Throws Error when it cannot be executed.
  void start();

  /// Reaps the worker if it has ended (never blocks); true once it is reaped.
  bool poll_exit();
  bool running() const { return pid_ > 0 && !reaped_; }
  bool reaped() const { return reaped_; }
  /// Sends `signal` to the worker's process group (also after the worker itself has ended, for
  /// what it left behind). Does nothing before start().
  void signal_group(int signal);

  pid_t pid() const { return pid_; }
  const WorkerSpec& spec() const { return spec_; }
  /// Valid once reaped().
  const ExitStatus& status() const { return status_; }
  /// Read ends of the captured output, or -1 (not captured, or closed).
  int stdout_fd() const { return stdout_fd_; }
  int stderr_fd() const { return stderr_fd_; }
  void close_stdout();
  void close_stderr();

 private:
  WorkerSpec spec_;
  bool capture_output_;
  pid_t pid_ = -1;
  bool reaped_ = false;
  ExitStatus status_;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
};

}  // namespace shoal::launcher
