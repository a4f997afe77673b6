#include "launcher/worker_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "shoal/error.h"

namespace shoal::launcher {
namespace {

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// In the child between fork and exec: only async-signal-safe calls from here on.
[[noreturn]] void exec_child(const char* program, char* const* argv, char* const* envp,
                             int out_fd, int err_fd, int status_fd, pid_t launcher) {
  ::setpgid(0, 0);
  // A worker must not outlive its launcher, however the launcher ends (kill -9 included): the
  // kernel sends SIGKILL when the forking thread dies. SIGKILL, not SIGTERM: a launcher that died
  // cannot stop a worker that ignores SIGTERM, and the job is over either way. If the launcher
  // already died before this line, the signal would never come: exit now.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(128 + SIGKILL);
  // Dispositions set to "ignore" (shoal ignores SIGPIPE) and blocked signals survive exec;
  // a worker starts with the defaults, as it would from a shell, except SIGUSR1: it starts
  // ignored (also across exec), so that the launcher's SIGUSR1 relay cannot kill a worker that
  // has not installed the dump handler (yet, or ever); init_process_group installs it over the
  // ignore when SHOAL_SIGUSR1_IGNORED=1 says the ignore is the launcher's (flight_recorder.h).
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  for (int s = 1; s < NSIG; ++s) {
    if (s != SIGKILL && s != SIGSTOP) ::sigaction(s, &action, nullptr);
  }
  action.sa_handler = SIG_IGN;
  ::sigaction(SIGUSR1, &action, nullptr);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);

  const int null_fd = ::open("/dev/null", O_RDONLY);
  if (null_fd >= 0 && null_fd != 0) {
    ::dup2(null_fd, 0);
    ::close(null_fd);
  }
  if (out_fd >= 0) ::dup2(out_fd, 1);  // dup2 clears O_CLOEXEC on the copy
  if (err_fd >= 0) ::dup2(err_fd, 2);
  ::execve(program, argv, envp);
  const int error = errno;
  [[maybe_unused]] ssize_t ignored = ::write(status_fd, &error, sizeof(error));
  ::_exit(127);
}

}  // namespace

WorkerProcess::WorkerProcess(WorkerSpec spec, bool capture_output)
    : spec_(std::move(spec)), capture_output_(capture_output) {}

WorkerProcess::~WorkerProcess() {
  if (running()) {
    signal_group(SIGKILL);
    // SIGKILL ends a process within milliseconds unless it is in an uninterruptible wait;
    // bound the wait so that a destructor never hangs.
    for (int i = 0; i < 500 && !poll_exit(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  close_stdout();
  close_stderr();
}

void WorkerProcess::start() {
  SHOAL_CHECK(pid_ < 0, spec_.label, " was already started");
  // Everything the child needs is built before fork: the child may only make async-signal-safe
  // calls (the launcher can run inside a multi-threaded program).
  std::vector<char*> argv;
  for (auto& arg : spec_.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (auto& var : spec_.env) envp.push_back(const_cast<char*>(var.c_str()));
  envp.push_back(nullptr);

  int out_pipe[2] = {-1, -1};
  int err_pipe[2] = {-1, -1};
  int status_pipe[2] = {-1, -1};
  auto close_all = [&] {
    for (int* p : {out_pipe, err_pipe, status_pipe}) {
      close_fd(p[0]);
      close_fd(p[1]);
    }
  };
  // O_CLOEXEC everywhere: no worker inherits another worker's pipes (their EOF would never come).
  bool ok = ::pipe2(status_pipe, O_CLOEXEC) == 0;
  if (ok && capture_output_) {
    ok = ::pipe2(out_pipe, O_CLOEXEC) == 0 && ::pipe2(err_pipe, O_CLOEXEC) == 0;
  }
  if (!ok) {
    const int error = errno;
    close_all();
    SHOAL_THROW(Error, "cannot start ", spec_.label, ": pipe: ", std::strerror(error));
  }

  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    close_all();
    SHOAL_THROW(Error, "cannot start ", spec_.label, ": fork: ", std::strerror(error));
  }
  if (pid == 0) {
    exec_child(spec_.program.c_str(), argv.data(), envp.data(), out_pipe[1], err_pipe[1],
               status_pipe[1], launcher);
  }
  pid_ = pid;
  // Also here, so the group exists before start() returns whoever runs first (the classic race).
  ::setpgid(pid, pid);
  close_fd(out_pipe[1]);
  close_fd(err_pipe[1]);
  close_fd(status_pipe[1]);
  stdout_fd_ = out_pipe[0];
  stderr_fd_ = err_pipe[0];
  for (int fd : {stdout_fd_, stderr_fd_}) {
    if (fd >= 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }

  // The status pipe closes on a successful exec (O_CLOEXEC) or carries errno when exec failed.
  pollfd pfd{status_pipe[0], POLLIN, 0};
  int ready;
  do {
    ready = ::poll(&pfd, 1, static_cast<int>(kExecTimeout.count()));
  } while (ready < 0 && errno == EINTR);
  int exec_error = 0;
  ssize_t got = 0;
  if (ready > 0) {
    do {
      got = ::read(status_pipe[0], &exec_error, sizeof(exec_error));
    } while (got < 0 && errno == EINTR);
  }
  close_fd(status_pipe[0]);
  if (ready == 0) {
    SHOAL_THROW(Error, "cannot start ", spec_.label, ": '", spec_.argv[0], "' did not start within ",
                kExecTimeout.count(), " ms");  // the destructor kills and reaps it
  }
  if (got == static_cast<ssize_t>(sizeof(exec_error))) {
    // The child has exited (127); reap it now.
    for (int i = 0; i < 500 && !poll_exit(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    SHOAL_THROW(Error, "cannot start ", spec_.label, ": cannot execute '", spec_.program, "': ",
                std::strerror(exec_error));
  }
}

bool WorkerProcess::poll_exit() {
  if (pid_ <= 0) return false;
  if (reaped_) return true;
  int status = 0;
  pid_t got;
  do {
    got = ::waitpid(pid_, &status, WNOHANG);
  } while (got < 0 && errno == EINTR);
  if (got == pid_) {
    reaped_ = true;
    status_ = ExitStatus::from_wait_status(status);
  } else if (got < 0 && errno == ECHILD) {
    // Reaped by someone else (a SIGCHLD handler of the embedding program): its status is lost.
    reaped_ = true;
    status_ = ExitStatus{255, 0};
  }
  return reaped_;
}

void WorkerProcess::signal_group(int signal) {
  if (pid_ <= 0) return;
  if (::kill(-pid_, signal) != 0 && !reaped_) {
    ::kill(pid_, signal);  // not yet in its own group (setpgid raced): signal the worker itself
  }
}

void WorkerProcess::close_stdout() { close_fd(stdout_fd_); }
void WorkerProcess::close_stderr() { close_fd(stderr_fd_); }

}  // namespace shoal::launcher
