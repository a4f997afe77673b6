// Runs a function in a forked child and reports how it ended and how much memory it took, so that
// a test can feed a hostile file to a reader and assert both a clean error and a bounded peak
// memory, without the test process itself crashing or swelling.
//
// Thread safety: call from a single-threaded point of the test (fork copies only this thread).
#pragma once

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

namespace shoal::testing {

struct ChildOutcome {
  bool exited = false;    // false: killed by a signal (see signal)
  int exit_code = -1;
  int signal = 0;
  std::string message;    // what the function returned (e.g. the error it caught)
  long peak_growth_kb = 0;  // the child's peak resident set minus its resident set when it started
  double seconds = 0;
};

/// Resident set of this process now, in KiB.
inline long resident_kb() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

/// Runs `fn` in a child; its return value comes back as `message`. The child exits 0 after `fn`
/// returns, 3 when `fn` throws (the message is then the exception's).
inline ChildOutcome run_in_child(const std::function<std::string()>& fn) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return {};
  std::fflush(nullptr);
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pipe_fds[0]);
    // A forked child's resident set starts below its parent's (page tables are copied lazily),
    // so its growth is measured from inside, against its own start.
    const long before = resident_kb();
    int code = 0;
    std::string message;
    try {
      message = fn();
    } catch (const std::exception& e) {
      message = e.what();
      code = 3;
    }
    struct rusage usage {};
    ::getrusage(RUSAGE_SELF, &usage);
    message = std::to_string(usage.ru_maxrss - before) + " " + message;
    size_t done = 0;
    while (done < message.size()) {
      const ssize_t n = ::write(pipe_fds[1], message.data() + done, message.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    ::_exit(code);
  }
  ::close(pipe_fds[1]);
  ChildOutcome out;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(pipe_fds[0], buffer, sizeof(buffer))) > 0) out.message.append(buffer, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  out.exited = WIFEXITED(status);
  out.exit_code = out.exited ? WEXITSTATUS(status) : -1;
  out.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  // The child's first word is its growth; the rest is the function's message.
  const size_t space = out.message.find(' ');
  if (out.exited && space != std::string::npos) {
    out.peak_growth_kb = std::atol(out.message.c_str());
    out.message.erase(0, space + 1);
  }
  return out;
}

}  // namespace shoal::testing
