// SignalRelay: turns SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGCHLD into bytes on a pipe that the launcher's
// monitoring loop polls together with its workers' output (the self-pipe trick), so that the loop
// never sleeps through a signal and the handlers themselves do nothing but one write().
//
// Thread safety: construct and destroy on one thread. A signal handler needs process-wide state,
// so only one SignalRelay may exist at a time; constructing a second throws InvalidArgument. The
// previous handlers are restored on destruction.
#pragma once

#include <signal.h>

#include <vector>

namespace shoal::launcher {

class SignalRelay {
 public:
  SignalRelay();
  ~SignalRelay();
  SignalRelay(const SignalRelay&) = delete;
  SignalRelay& operator=(const SignalRelay&) = delete;

  /// Readable when a signal arrived since the last drain().
  int fd() const { return read_fd_; }
  /// The signals received since the last call, in order (never blocks).
  std::vector<int> drain();

 private:
  // SIGHUP (the terminal closed) and SIGQUIT stop the job like SIGINT: forwarded to the workers.
  // SIGUSR1 asks every worker for its recent operations (flight_recorder.h) and stops nothing.
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGCHLD};
  static constexpr size_t kCount = sizeof(kSignals) / sizeof(kSignals[0]);
  int read_fd_ = -1;
  int write_fd_ = -1;
  struct sigaction previous_[kCount];
};

}  // namespace shoal::launcher
