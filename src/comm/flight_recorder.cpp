#include "shoal/comm/flight_recorder.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shoal/comm/process_group.h"
#include "shoal/env.h"

namespace shoal::comm {
namespace {

// The live groups. Never destroyed: groups may die during static destruction.
std::mutex& registry_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}

std::vector<ProcessGroup*>& registry() {
  static auto* groups = new std::vector<ProcessGroup*>();
  return *groups;
}

int g_wake_fd = -1;  // the write end of the pipe the handler wakes the dump thread with

void on_sigusr1(int) {
  const int saved = errno;
  const char byte = 1;
  if (g_wake_fd >= 0) (void)!::write(g_wake_fd, &byte, 1);  // async-signal-safe
  errno = saved;
}

}  // namespace

void register_process_group(ProcessGroup* group) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(group);
}

void unregister_process_group(ProcessGroup* group) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& groups = registry();
  groups.erase(std::remove(groups.begin(), groups.end(), group), groups.end());
}

void dump_recent_operations(std::FILE* out) {
  // Held throughout: a group cannot be destroyed while it is being read (its destructor waits).
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::string text = "shoal: recent operations of " + std::to_string(registry().size()) +
                     " process group(s) in pid " + std::to_string(::getpid()) + "\n";
  for (const ProcessGroup* group : registry()) {
    const auto operations = group->recent_operations();
    text += "  " + group->rank_prefix() +
            (operations.empty() ? " no operation yet\n" : " last " +
                                     std::to_string(operations.size()) + " operation(s):\n");
    for (const std::string& op : operations) text += "    " + op + "\n";
  }
  std::fputs(text.c_str(), out);
  std::fflush(out);
}

void install_dump_on_sigusr1() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!env::flag(env::Var::kSigusr1)) return;
    struct sigaction current {};
    if (::sigaction(SIGUSR1, nullptr, &current) != 0) return;
    if (current.sa_flags & SA_SIGINFO) return;  // the program's own handler
    if (current.sa_handler == SIG_IGN) {
      // Ignored: by `shoal run` until now (replace it), or by the program (keep it).
      if (!env::flag(env::Var::kSigusr1Ignored)) return;
    } else if (current.sa_handler != SIG_DFL) {
      return;  // the program's own handler
    }
    int fds[2];
    if (::pipe(fds) != 0) return;
    g_wake_fd = fds[1];
    std::thread([read_fd = fds[0]] {
      char byte;
      while (true) {
        const ssize_t n = ::read(read_fd, &byte, 1);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        dump_recent_operations(stderr);
      }
    }).detach();
    struct sigaction action {};
    action.sa_handler = on_sigusr1;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR1, &action, nullptr);
  });
}

}  // namespace shoal::comm
