#include "testing/multi_rank.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace shoal::testing {

void run_threads(int world_size, const std::function<void(int)>& fn, Milliseconds deadline) {
  std::mutex mutex;
  std::exception_ptr first_error;
  int first_rank = -1;
  std::atomic<int> running{world_size};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        fn(rank);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first_error) {
          first_error = std::current_exception();
          first_rank = rank;
        }
      }
      --running;
    });
  }
  const auto until = std::chrono::steady_clock::now() + deadline;
  while (running.load() > 0) {
    if (std::chrono::steady_clock::now() > until) {
      std::fprintf(stderr, "run_threads: %d of %d ranks still running after %lld ms: a hang\n",
                   running.load(), world_size, static_cast<long long>(deadline.count()));
      std::fflush(stderr);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(Milliseconds(5));
  }
  for (auto& t : threads) t.join();
  if (first_error) {
    try {
      std::rethrow_exception(first_error);
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(first_rank) + ": " + e.what());
    }
  }
}

ChildProcess::ChildProcess(const std::function<void()>& fn) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  start_ = std::chrono::steady_clock::now();
  std::fflush(stdout);
  std::fflush(stderr);
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    close(fds[0]);
    int code = 0;
    try {
      fn();
    } catch (const std::exception& e) {
      const std::string what = e.what();
      ssize_t ignored = write(fds[1], what.data(), what.size());
      (void)ignored;
      code = 1;
    } catch (...) {
      code = 1;
    }
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(code);  // no atexit handlers or static destructors of the parent's state
  }
  close(fds[1]);
  error_fd_ = fds[0];
  fcntl(error_fd_, F_SETFL, O_NONBLOCK);
}

ChildProcess::~ChildProcess() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  if (error_fd_ >= 0) close(error_fd_);
}

void ChildProcess::kill(int signal) {
  if (!reaped_ && pid_ > 0) ::kill(pid_, signal);
}

bool ChildProcess::wait(Milliseconds timeout) {
  if (reaped_) return true;
  const auto until = std::chrono::steady_clock::now() + timeout;
  char buffer[4096];
  while (true) {
    ssize_t n;
    while ((n = read(error_fd_, buffer, sizeof buffer)) > 0) result_.error.append(buffer, n);
    int status = 0;
    pid_t done = waitpid(pid_, &status, WNOHANG);
    if (done == pid_) {
      while ((n = read(error_fd_, buffer, sizeof buffer)) > 0) result_.error.append(buffer, n);
      reaped_ = true;
      result_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      if (WIFEXITED(status)) {
        result_.exit_code = WEXITSTATUS(status);
      } else if (WIFSIGNALED(status)) {
        result_.signal = WTERMSIG(status);
      }
      return true;
    }
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(Milliseconds(2));
  }
}

std::vector<ProcessResult> run_processes(
    int world_size, const std::function<void(int, const std::string&)>& fn, Milliseconds deadline) {
  const std::string store_path = temp_path("store");
  std::vector<std::unique_ptr<ChildProcess>> children;
  for (int rank = 0; rank < world_size; ++rank) {
    children.push_back(std::make_unique<ChildProcess>([&, rank] { fn(rank, store_path); }));
  }
  const auto until = std::chrono::steady_clock::now() + deadline;
  std::vector<ProcessResult> results;
  for (int rank = 0; rank < world_size; ++rank) {
    auto left = std::chrono::duration_cast<Milliseconds>(until - std::chrono::steady_clock::now());
    if (!children[rank]->wait(std::max(left, Milliseconds(0)))) {
      children[rank]->kill(SIGKILL);
      children[rank]->wait(Milliseconds(10'000));
    }
    ProcessResult result = children[rank]->result();
    result.rank = rank;
    results.push_back(result);
  }
  // The store and any signal files the ranks made next to it ("<store>.<what>").
  std::error_code ignored;
  const std::filesystem::path store(store_path);
  const std::string prefix = store.filename().string() + ".";
  for (const auto& entry : std::filesystem::directory_iterator(store.parent_path(), ignored)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(entry.path(), ignored);
  }
  std::filesystem::remove(store_path, ignored);
  return results;
}

void touch_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("touch_file: cannot create " + path);
  ::close(fd);
}

bool wait_until(const std::function<bool()>& condition, Milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > until) return condition();  // one last look
    std::this_thread::sleep_for(Milliseconds(5));
  }
  return true;
}

bool wait_for_files(const std::vector<std::string>& paths, Milliseconds timeout) {
  return wait_until([&] {
    for (const auto& path : paths) {
      if (::access(path.c_str(), F_OK) != 0) return false;
    }
    return true;
  }, timeout);
}

std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  const char* dir = std::getenv("TMPDIR");
  std::string base = (dir != nullptr && *dir) ? dir : "/tmp";
  return base + "/shoal-test-" + stem + "-" + std::to_string(getpid()) + "-" +
         std::to_string(counter++);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void skip_program(Dependency dependency, const std::string& reason) {
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  const ::testing::TestInfo* current = unit.current_test_info();
  const bool failed = unit.failed_test_count() > 0 || unit.Failed() ||
                      (current != nullptr && current->result()->Failed());
  std::fflush(stdout);
  if (failed) {
    std::fprintf(stderr, "FAILED: not skipping (%s): a test has already failed\n", reason.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  if (skip_is_failure(dependency)) {
    std::fprintf(stderr, "FAILED: %s\n", forbidden_skip_message(reason).c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  std::printf("SKIPPED: %s\n", reason.c_str());
  std::fflush(stdout);
  std::_Exit(kSkipExitCode);
}

void skip_program(const std::string& reason) { skip_program(Dependency::kPythonTorch, reason); }

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    throw std::runtime_error("free_port: bind failed");
  }
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace shoal::testing
