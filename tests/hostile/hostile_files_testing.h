// Helpers of the hostile-file tests (tests/hostile/test_hostile_files_*.cpp): run the shoal CLI
// as a user would, under a deadline, and measure its peak resident size (wait4's ru_maxrss, the
// kernel's VmHWM); write torch.save-shaped archives and pickles byte by byte.
//
// Thread safety: call from the test's main thread (fork).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "compat/torch_archive.h"
#include "testing/multi_rank.h"

namespace shoal::testing::hostile_files {

/// build/apps/shoal/shoal (from ctest's SHOAL_BINARY_DIR); skips the program when absent.
inline std::string shoal_cli() {
  const char* dir = std::getenv("SHOAL_BINARY_DIR");
  if (dir == nullptr) skip_program("SHOAL_BINARY_DIR is not set (run through ctest)");
  const std::string path = std::string(dir) + "/apps/shoal/shoal";
  if (!std::filesystem::exists(path)) skip_program(path + " is not built");
  return path;
}

struct CliRun {
  int exit_code = -1;      // -1 when killed by a signal
  int signal = 0;
  bool timed_out = false;  // killed by run_cli at its deadline
  long peak_kb = 0;        // the process's peak resident set (VmHWM)
  double seconds = 0;
  uint64_t output_bytes = 0;  // all it wrote to stdout and stderr
  std::string head;           // the first 64 KiB of that
  std::string tail;           // and the last 64 KiB
  std::string text() const { return head + (output_bytes > head.size() ? "\n...\n" + tail : ""); }
};

/// Runs `args` (args[0] is the program) with stdout and stderr read through one pipe (kept only
/// in part, so an old reader printing gigabytes cannot fill the disk), killed at `deadline_s`.
inline CliRun run_cli(const std::vector<std::string>& args, double deadline_s) {
  constexpr size_t kKeep = 64 * 1024;
  CliRun run;
  int fds[2];
  if (::pipe(fds) != 0) return run;
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
  const auto deadline = start + std::chrono::duration<double>(deadline_s);
  char buffer[1 << 16];
  bool open = true;
  while (open) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      run.timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    ::poll(&p, 1, 200);
    while (true) {
      const ssize_t n = ::read(fds[0], buffer, sizeof(buffer));
      if (n == 0) open = false;
      if (n <= 0) break;
      run.output_bytes += static_cast<uint64_t>(n);
      const std::string piece(buffer, static_cast<size_t>(n));
      if (run.head.size() < kKeep) run.head += piece.substr(0, kKeep - run.head.size());
      run.tail += piece;
      if (run.tail.size() > 2 * kKeep) run.tail.erase(0, run.tail.size() - kKeep);
    }
  }
  ::close(fds[0]);
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.peak_kb = usage.ru_maxrss;
  if (WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) run.signal = WTERMSIG(status);
  if (run.tail.size() > kKeep) run.tail.erase(0, run.tail.size() - kKeep);
  return run;
}

/// A torch.save-shaped archive of `records` (name, bytes), in order; no checksum manifest unless
/// one is among them (a file from Python has none).
inline void write_archive(const std::string& path,
                          const std::vector<std::pair<std::string, std::string>>& records) {
  std::ofstream out(path, std::ios::binary);
  compat::TorchArchiveWriter writer([&out](const void* data, size_t size) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
    return out ? size : 0;
  });
  for (const auto& [name, bytes] : records) writer.write(name, bytes.data(), bytes.size());
  writer.finish();
}

/// Every record of the archive at `path`, in its order.
inline std::vector<std::pair<std::string, std::string>> read_archive(const std::string& path) {
  compat::TorchArchiveReader reader(path);
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& name : reader.records()) out.emplace_back(name, reader.read(name));
  return out;
}

// Pickle pieces (protocol 2), as torch.save writes them.
inline std::string u32(uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); }
inline std::string text(const std::string& s) { return "X" + u32(static_cast<uint32_t>(s.size())) + s; }
inline std::string global(const std::string& module, const std::string& name) {
  return "c" + module + "\n" + name + "\n";
}
inline std::string small_int(uint8_t v) { return std::string("K") + static_cast<char>(v); }
inline std::string int32(int32_t v) { return "J" + u32(static_cast<uint32_t>(v)); }

}  // namespace shoal::testing::hostile_files
