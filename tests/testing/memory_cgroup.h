// A memory cgroup a test makes under its own process's cgroup, to run code under a memory limit
// that counts (and reclaims) the page cache, which RLIMIT_AS and RLIMIT_DATA do not: v1's
// memory.limit_in_bytes, or v2's memory.max. Removed on destruction; made() is false where no
// memory cgroup is writable (the test then skips).
//
// Thread safety: none; one test thread uses it.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

namespace shoal::testing {

/// The whole text of the file at `path` ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// A cgroup limited to `limit` bytes of memory, made under this process's own.
class MemoryCgroup {
 public:
  explicit MemoryCgroup(int64_t limit) {
    for (const auto& [controller_file, limit_file] :
         {std::pair<std::string, std::string>{"memory", "memory.limit_in_bytes"},
          {"", "memory.max"}}) {
      const std::string own = own_cgroup(controller_file);
      if (own.empty()) continue;
      const std::string root = controller_file.empty() ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
      const std::string dir = root + own + "/shoal-test-" + std::to_string(::getpid());
      if (::mkdir(dir.c_str(), 0755) != 0) continue;
      std::ofstream(dir + "/" + limit_file) << limit;
      if (slurp(dir + "/" + limit_file) == std::to_string(limit) + "\n") {
        dir_ = dir;
        v1_ = !controller_file.empty();
        return;
      }
      ::rmdir(dir.c_str());
    }
  }
  ~MemoryCgroup() {
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  bool made() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  /// Moves the calling process into the cgroup.
  bool enter() const {
    std::ofstream(dir_ + "/cgroup.procs") << ::getpid() << std::endl;
    return slurp("/proc/self/cgroup").find(dir_.substr(dir_.rfind('/'))) != std::string::npos;
  }
  /// How often usage reached the limit.
  int64_t times_limit_reached() const {
    if (v1_) return std::stoll("0" + slurp(dir_ + "/memory.failcnt"));
    const std::string events = slurp(dir_ + "/memory.events");
    const size_t at = events.find("\nmax ");
    return at == std::string::npos ? 0 : std::stoll(events.substr(at + 5));
  }

 private:
  /// This process's cgroup path under the v1 `controller` ("" for the v2 hierarchy), or "".
  static std::string own_cgroup(const std::string& controller) {
    std::istringstream lines(slurp("/proc/self/cgroup"));
    for (std::string line; std::getline(lines, line);) {
      const size_t first = line.find(':');
      const size_t second = line.find(':', first + 1);
      if (first == std::string::npos || second == std::string::npos) continue;
      const std::string controllers = line.substr(first + 1, second - first - 1);
      if (controllers == controller || ("," + controllers + ",").find("," + controller + ",") != std::string::npos) {
        if (!controller.empty() || line.rfind("0::", 0) == 0) return line.substr(second + 1);
      }
    }
    return "";
  }
  std::string dir_;
  bool v1_ = false;
};

}  // namespace shoal::testing
