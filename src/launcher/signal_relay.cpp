#include "launcher/signal_relay.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "shoal/error.h"

namespace shoal::launcher {
namespace {

// The pipe's write end, for the handler (a handler can reach nothing else). -1: no relay.
std::atomic<int> g_relay_write_fd{-1};

extern "C" void relay_signal(int signal) {
  const int saved_errno = errno;
  const int fd = g_relay_write_fd.load();
  if (fd >= 0) {
    const unsigned char byte = static_cast<unsigned char>(signal);
    // Non-blocking: with a full pipe the loop is awake anyway, and a lost SIGCHLD byte is covered
    // by the loop's periodic waitpid().
    [[maybe_unused]] ssize_t ignored = ::write(fd, &byte, 1);
  }
  errno = saved_errno;
}

}  // namespace

SignalRelay::SignalRelay() {
  int fds[2];
  SHOAL_CHECK(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0, "cannot create the launcher's signal pipe: ",
              std::strerror(errno));
  int expected = -1;
  if (!g_relay_write_fd.compare_exchange_strong(expected, fds[1])) {
    ::close(fds[0]);
    ::close(fds[1]);
    SHOAL_THROW(InvalidArgument, "a launch is already running in this process; run one at a time");
  }
  read_fd_ = fds[0];
  write_fd_ = fds[1];
  struct sigaction action {};
  action.sa_handler = relay_signal;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < kCount; ++i) {
    // SA_NOCLDSTOP: a stopped worker is not an exited one. SA_RESTART: other threads' syscalls
    // (when launch() runs inside a larger program) are not disturbed.
    action.sa_flags = SA_RESTART | (kSignals[i] == SIGCHLD ? SA_NOCLDSTOP : 0);
    ::sigaction(kSignals[i], &action, &previous_[i]);
  }
  // The signals may be blocked in this thread (inherited masks); the relay must see them.
  sigset_t set;
  sigemptyset(&set);
  for (int s : kSignals) sigaddset(&set, s);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

SignalRelay::~SignalRelay() {
  for (size_t i = 0; i < kCount; ++i) ::sigaction(kSignals[i], &previous_[i], nullptr);
  g_relay_write_fd.store(-1);
  ::close(read_fd_);
  ::close(write_fd_);
}

std::vector<int> SignalRelay::drain() {
  std::vector<int> signals;
  unsigned char buffer[64];
  for (;;) {
    const ssize_t n = ::read(read_fd_, buffer, sizeof(buffer));
    if (n > 0) {
      signals.insert(signals.end(), buffer, buffer + n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;  // EAGAIN: empty
    }
  }
  return signals;
}

}  // namespace shoal::launcher
