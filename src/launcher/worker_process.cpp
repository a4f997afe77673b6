#include "launcher/worker_process.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <linux/prctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "compat/thread_parallelism.h"
#include "shoal/env.h"
#include "shoal/error.h"
#include "shoal/launcher/launch.h"

namespace shoal::launcher {
namespace {

std::atomic<SelfEntry> g_self_entry{nullptr};

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Whether this process runs a single thread: fork() then leaves no lock held by a thread that does
// not exist in the child, and the child may run anything.
bool single_threaded() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return false;
  int threads = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++threads;
  }
  ::closedir(dir);
  return threads == 1;
}

// OpenBLAS (Debian's LibTorch calls it) starts its server threads when it loads, and stops them
// itself before every fork (its own pthread_atfork handler), to start them again when next needed:
// stopped here first, they do not make the launcher look multi-threaded.
void stop_blas_threads() {
  using Shutdown = int (*)();
  if (auto shutdown = reinterpret_cast<Shutdown>(::dlsym(RTLD_DEFAULT, "blas_thread_shutdown_"))) {
    shutdown();
  }
}

// Whether `program` is this program's file (the same inode, whatever the path).
bool is_this_program(const std::string& program) {
  struct stat mine {};
  struct stat theirs {};
  return ::stat("/proc/self/exe", &mine) == 0 && ::stat(program.c_str(), &theirs) == 0 &&
         mine.st_dev == theirs.st_dev && mine.st_ino == theirs.st_ino;
}

bool exec_forced() {
  return env::flag(env::Var::kLaunchExec);
}

// In the child right after fork, before exec or the entry: what every worker starts with.
// Async-signal-safe calls only (before exec the launcher may have had other threads).
void prepare_child(int out_fd, int err_fd, pid_t launcher) {
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
}

// Closes every descriptor from 3 on but `keep` (-1: none): a worker starts with stdin, stdout and
// stderr only, as torchrun's do (Python's close_fds), whatever the launcher itself inherited
// without O_CLOEXEC. Async-signal-safe: `max_fd` (the limit, for kernels without close_range) is
// looked up before fork.
void close_descriptors(int keep, int max_fd) {
  const auto close_span = [max_fd](int first, int last) {  // [first, last]
    if (first > last) return;
#ifdef SYS_close_range
    if (::syscall(SYS_close_range, static_cast<unsigned>(first), static_cast<unsigned>(last), 0) == 0) {
      return;
    }
#endif
    for (int fd = first; fd <= std::min(last, max_fd); ++fd) ::close(fd);
  };
  if (keep >= 3) {
    close_span(3, keep - 1);
    close_span(keep + 1, std::numeric_limits<int>::max());
  } else {
    close_span(3, std::numeric_limits<int>::max());
  }
}

// In the child between fork and exec: only async-signal-safe calls from here on.
[[noreturn]] void exec_child(const char* program, char* const* argv, char* const* envp,
                             int out_fd, int err_fd, int status_fd, pid_t launcher, int max_fd) {
  prepare_child(out_fd, err_fd, launcher);
  close_descriptors(status_fd, max_fd);  // the status pipe closes on exec (O_CLOEXEC)
  ::execve(program, argv, envp);
  const int error = errno;
  [[maybe_unused]] ssize_t ignored = ::write(status_fd, &error, sizeof(error));
  ::_exit(127);
}

// LibTorch's intra-op threads and OpenBLAS's come from OMP_NUM_THREADS when the libraries load,
// which in a forked worker happened in the launcher, before the worker's environment existed.
void apply_thread_count() {
  const char* text = std::getenv("OMP_NUM_THREADS");
  if (text == nullptr) return;
  char* end = nullptr;
  const long threads = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || threads < 1 || threads > 4096) return;
  compat::set_compute_threads(static_cast<int>(threads));
}

// /proc/PID/environ and /proc/PID/cmdline show what the kernel noted at exec: a worker started
// without exec would show the launcher's (no RANK), to ps, to /proc readers, to tests that look
// for a rank. Points the kernel at the worker's own arguments and environment, laid out as exec
// lays them out, with PR_SET_MM_MAP (CRIU's restore call: no privilege needed while the
// executable stays the same; every other field is passed back unchanged). False when the kernel
// refuses (built without checkpoint/restore): the caller execs instead.
bool show_own_arguments_and_environment(char** argv, char** envp) {
  std::ifstream in("/proc/self/stat");
  std::string stat;
  std::getline(in, stat);
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream fields(stat.substr(close + 2));  // from field 3 (state) on
  std::vector<unsigned long long> field(53, 0);
  std::string word;
  for (int i = 3; i <= 52 && fields >> word; ++i) {
    field[i] = std::strtoull(word.c_str(), nullptr, 10);
  }
  // One block, never freed (the process's life): the arguments, then the environment.
  std::string block;
  for (char** arg = argv; *arg != nullptr; ++arg) block.append(*arg).push_back('\0');
  const size_t args_bytes = block.size();
  for (char** var = envp; *var != nullptr; ++var) block.append(*var).push_back('\0');
  char* memory = static_cast<char*>(std::malloc(block.size() + 1));
  if (memory == nullptr) return false;
  std::memcpy(memory, block.data(), block.size());
  const auto at = [&](size_t offset) {
    return static_cast<__u64>(reinterpret_cast<uintptr_t>(memory + offset));
  };
  prctl_mm_map map {};
  map.start_code = field[26];
  map.end_code = field[27];
  map.start_stack = field[28];
  map.start_data = field[45];
  map.end_data = field[46];
  map.start_brk = field[47];
  map.brk = static_cast<__u64>(reinterpret_cast<uintptr_t>(::sbrk(0)));
  map.arg_start = at(0);
  map.arg_end = at(args_bytes);
  map.env_start = at(args_bytes);
  map.env_end = at(block.size());
  map.auxv = nullptr;
  map.auxv_size = 0;
  map.exe_fd = static_cast<__u32>(-1);
  if (map.start_code == 0 || map.start_data == 0 ||
      ::prctl(PR_SET_MM, PR_SET_MM_MAP, &map, sizeof map, 0) != 0) {
    std::free(memory);
    return false;
  }
  return true;
}

// In the child of a single-threaded launcher: the worker is this program, run from its main
// without exec (set_self_entry()). Its stack below this frame is the launcher's, never returned to.
[[noreturn]] void run_entry(SelfEntry entry, const char* program, char** argv, char** envp,
                            int out_fd, int err_fd, int status_fd, pid_t launcher, int max_fd) {
  if (!show_own_arguments_and_environment(argv, envp)) {
    exec_child(program, argv, envp, out_fd, err_fd, status_fd, launcher, max_fd);
  }
  prepare_child(out_fd, err_fd, launcher);
  close_descriptors(-1, max_fd);  // the status pipe too: its end tells the launcher we started
  ::clearenv();
  for (char** var = envp; *var != nullptr; ++var) ::putenv(*var);
  apply_thread_count();
  int argc = 0;
  while (argv[argc] != nullptr) ++argc;
  int code = 1;
  try {
    code = entry(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: uncaught exception: %s\n", argv[0], e.what());
  } catch (...) {
    std::fprintf(stderr, "%s: uncaught exception\n", argv[0]);
  }
  std::fflush(nullptr);
  std::exit(code);  // as main's return: static destructors and atexit handlers run
}

}  // namespace

void set_self_entry(SelfEntry entry) { g_self_entry.store(entry); }

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

  // Without exec when the worker is this program and nothing else runs here (launch.h).
  const SelfEntry entry = g_self_entry.load();
  bool in_process = entry != nullptr && !exec_forced() && is_this_program(spec_.program);
  if (in_process) {
    stop_blas_threads();
    in_process = single_threaded();
  }
  // What stdio holds unwritten would otherwise be written by the worker too.
  if (in_process) std::fflush(nullptr);
  const long open_max = ::sysconf(_SC_OPEN_MAX);
  const int max_fd = open_max > 0 && open_max < (1 << 20) ? static_cast<int>(open_max) : (1 << 20);
  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    close_all();
    SHOAL_THROW(Error, "cannot start ", spec_.label, ": fork: ", std::strerror(error));
  }
  if (pid == 0) {
    if (in_process) {
      run_entry(entry, spec_.program.c_str(), argv.data(), envp.data(), out_pipe[1], err_pipe[1],
                status_pipe[1], launcher, max_fd);
    }
    exec_child(spec_.program.c_str(), argv.data(), envp.data(), out_pipe[1], err_pipe[1],
               status_pipe[1], launcher, max_fd);
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
