// launch() starting workers that are this program itself without exec (set_self_entry): each
// worker must start as an exec'd one would (its own environment and rank, its own process group,
// stdin from /dev/null, no inherited descriptor, default signal dispositions with SIGUSR1 ignored,
// an empty signal mask, the thread count of its OMP_NUM_THREADS, its own arguments and
// environment in /proc/PID/cmdline and /proc/PID/environ), and the launcher must fall back
// to exec when it has another thread (fork would leave that thread's locks held) or when
// SHOAL_LAUNCH_EXEC=1 says so.
//
// The worker is this test program: forked, it runs report_entry (the entry set here); exec'd, the
// program's main runs LauncherSelfEntryWorker.WorkerReport alone (--gtest_filter). Either way the worker
// writes what it sees to a file per rank, and g_marker tells the two apart: the launching test sets
// it, so only a forked worker still has it.
#include <gtest/gtest.h>
#include <ATen/Parallel.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shoal/launcher/launch.h"

namespace test_self_entry {
namespace fs = std::filesystem;

int g_marker = 0;
constexpr const char* kReportDir = "SHOAL_TEST_SELF_ENTRY_DIR";

std::string disposition(int signal) {
  struct sigaction action {};
  ::sigaction(signal, nullptr, &action);
  if (action.sa_handler == SIG_IGN) return "ignored";
  if (action.sa_handler == SIG_DFL) return "default";
  return "handled";
}

// What a worker sees, one "key=value" line each.
void write_report() {
  std::string fds;  // listed first: the report file below is a descriptor too
  if (DIR* listing = ::opendir("/proc/self/fd")) {
    while (const dirent* entry = ::readdir(listing)) {
      if (entry->d_name[0] == '.' || std::atoi(entry->d_name) == ::dirfd(listing)) continue;
      fds += std::string(fds.empty() ? "" : ",") + entry->d_name;
    }
    ::closedir(listing);
  }
  const char* dir = std::getenv(kReportDir);
  const char* rank = std::getenv("RANK");
  std::ofstream out(std::string(dir) + "/rank" + (rank != nullptr ? rank : "unknown"));
  out << "marker=" << g_marker << "\n";
  for (const char* name : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS"}) {
    const char* value = std::getenv(name);
    out << name << "=" << (value != nullptr ? value : "(unset)") << "\n";
  }
  out << "fds=" << fds << "\n";  // unordered: compared as a set below
  // What ps and /proc readers see (the kernel's copy): the worker's own, not the launcher's.
  std::ifstream environ_file("/proc/self/environ", std::ios::binary);
  std::string proc_rank = "(unset)";
  for (std::string entry; std::getline(environ_file, entry, '\0');) {
    if (entry.rfind("RANK=", 0) == 0) proc_rank = entry.substr(5);
  }
  out << "proc_RANK=" << proc_rank << "\n";
  std::ifstream cmdline_file("/proc/self/cmdline", std::ios::binary);
  std::string last_argument;
  for (std::string argument; std::getline(cmdline_file, argument, '\0');) last_argument = argument;
  out << "proc_last_argument=" << last_argument << "\n";
  char target[256] = {};
  const ssize_t n = ::readlink("/proc/self/fd/0", target, sizeof target - 1);
  out << "stdin=" << (n > 0 ? std::string(target, static_cast<size_t>(n)) : "?") << "\n";
  out << "own_group=" << (::getpgrp() == ::getpid() ? 1 : 0) << "\n";
  out << "SIGUSR1=" << disposition(SIGUSR1) << "\nSIGTERM=" << disposition(SIGTERM)
      << "\nSIGPIPE=" << disposition(SIGPIPE) << "\n";
  sigset_t mask;
  sigemptyset(&mask);
  ::sigprocmask(SIG_BLOCK, nullptr, &mask);
  out << "blocked_SIGTERM=" << sigismember(&mask, SIGTERM) << "\n";
  out << "threads=" << at::get_num_threads() << "\n";
}

int report_entry(int, char**) {
  write_report();
  return 0;
}

TEST(LauncherSelfEntryWorker, WorkerReport) {
  if (std::getenv(kReportDir) == nullptr) GTEST_SKIP() << "a worker of the other cases, not a test";
  write_report();
}

std::map<std::string, std::string> read_report(const fs::path& path) {
  std::ifstream in(path);
  std::map<std::string, std::string> report;
  for (std::string line; std::getline(in, line);) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) report[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return report;
}

class LauncherSelfEntry : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shoal_self_entry_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    ::setenv(kReportDir, dir_.c_str(), 1);
    ::unsetenv("SHOAL_LAUNCH_EXEC");
    // The workers' OMP_NUM_THREADS=2 must reach a forked worker's LibTorch, which took its thread
    // count from this process's OMP_NUM_THREADS=1 (ctest's) when it loaded.
    ::setenv("OMP_NUM_THREADS", "2", 1);
    shoal::launcher::set_self_entry(&report_entry);
    g_marker = 42;
  }
  void TearDown() override {
    shoal::launcher::set_self_entry(nullptr);
    ::unsetenv(kReportDir);
    ::unsetenv("SHOAL_LAUNCH_EXEC");
    ::setenv("OMP_NUM_THREADS", "1", 1);
    fs::remove_all(dir_);
  }

  // Two workers of this program; returns their reports by rank.
  std::vector<std::map<std::string, std::string>> launch_two() {
    auto options = shoal::launcher::LaunchOptions::workers(
        2, {shoal::launcher::self_executable(), "--shoal_sources=test_self_entry.cpp",
            "--gtest_filter=LauncherSelfEntryWorker.WorkerReport"});
    options.master_port = 0;
    options.verbose = false;
    EXPECT_EQ(shoal::launcher::launch(options), 0);
    std::vector<std::map<std::string, std::string>> reports;
    for (int rank = 0; rank < 2; ++rank) {
      const fs::path path = dir_ / ("rank" + std::to_string(rank));
      EXPECT_TRUE(fs::exists(path)) << "rank " << rank << " wrote no report";
      reports.push_back(read_report(path));
    }
    return reports;
  }

  // What an exec'd worker starts with, and what a forked one must start with too.
  static void expect_fresh_worker(const std::map<std::string, std::string>& report, int rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_EQ(report.at("RANK"), std::to_string(rank));
    EXPECT_EQ(report.at("proc_RANK"), std::to_string(rank));
    EXPECT_EQ(report.at("proc_last_argument"), "--gtest_filter=LauncherSelfEntryWorker.WorkerReport");
    EXPECT_EQ(report.at("LOCAL_RANK"), std::to_string(rank));
    EXPECT_EQ(report.at("WORLD_SIZE"), "2");
    EXPECT_EQ(report.at("OMP_NUM_THREADS"), "2");
    EXPECT_EQ(report.at("threads"), "2");
    std::stringstream fds(report.at("fds"));
    std::vector<std::string> open;
    for (std::string fd; std::getline(fds, fd, ',');) open.push_back(fd);
    std::sort(open.begin(), open.end());
    EXPECT_EQ(open, (std::vector<std::string>{"0", "1", "2"})) << report.at("fds");
    EXPECT_EQ(report.at("stdin"), "/dev/null");
    EXPECT_EQ(report.at("own_group"), "1");
    EXPECT_EQ(report.at("SIGUSR1"), "ignored");  // until init_process_group installs its dump
    EXPECT_EQ(report.at("SIGTERM"), "default");
    EXPECT_EQ(report.at("blocked_SIGTERM"), "0");
  }

  fs::path dir_;
};

TEST_F(LauncherSelfEntry, WorkersOfThisProgramStartWithoutExecAsAnExecedOneWould) {
  const auto reports = launch_two();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(reports[rank].at("marker"), "42") << "rank " << rank << " was exec'd, not forked";
    expect_fresh_worker(reports[rank], rank);
  }
}

TEST_F(LauncherSelfEntry, AnotherThreadInTheLauncherMeansExec) {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::thread other([&] {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return done; });
  });
  const auto reports = launch_two();
  {
    std::lock_guard<std::mutex> lock(mutex);
    done = true;
  }
  cv.notify_all();
  other.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(reports[rank].at("marker"), "0") << "rank " << rank << " was forked beside a thread";
    expect_fresh_worker(reports[rank], rank);
  }
}

TEST_F(LauncherSelfEntry, LaunchExecSettingMeansExec) {
  ::setenv("SHOAL_LAUNCH_EXEC", "1", 1);
  const auto reports = launch_two();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(reports[rank].at("marker"), "0") << "rank " << rank << " was forked";
    expect_fresh_worker(reports[rank], rank);
  }
}

}  // namespace test_self_entry
