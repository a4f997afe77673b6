// How the shm backend's ranks wait for each other: ProcessGroupShm::wait_until, the one loop
// behind every wait (rounds, point-to-point), which spins, then yields, then sleeps, checking
// the deadline, the abort flag and the peer's pid on the way. Private to src/comm/shm/.
//
// Thread safety: as ProcessGroupShm (each lane waits on its own thread).
#pragma once

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include "comm/peer_directory.h"
#include "comm/shm/segment_layout.h"
#include "comm/timeouts.h"

namespace shoal::comm::shm {

// Waiting: spin (ShmOptions::spin_time), then yield, then sleep.
// Then sched_yield for 2 ms: hands the core to a peer queued on it while still reacting within a
// scheduler tick; then sleep 100 us per check, which costs nothing on long waits (a slow rank
// computing its backward pass) and adds at most 100 us to them.
constexpr auto kYieldTime = std::chrono::milliseconds(2);
constexpr auto kSleepTime = std::chrono::microseconds(100);
// How often a slow wait looks at peers' pids, the abort flag and the deadline: /proc reads cost
// ~10 us, so every 5 ms is cheap and still reports a dead peer at once on a human scale.
constexpr auto kCheckInterval = std::chrono::milliseconds(5);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}


template <class Ready>
void ProcessGroupShm::wait_until(int peer, const Running& op, Ready ready) {
  if (ready()) return;
  const auto begin = Clock::now();
  // Spin for the adaptive budget (see ShmOptions::spin_time): a wait that ends while spinning
  // doubles it, one that has to yield halves it, so a busy machine stops spinning on its own.
  const auto budget = std::chrono::nanoseconds(spin_budget_ns_.load(std::memory_order_relaxed));
  do {
    for (int i = 0; i < 16; ++i) {
      cpu_relax();
      if (ready()) {
        const int64_t grown = std::min<int64_t>(2 * budget.count() + 1000, max_spin_ns_);
        spin_budget_ns_.store(grown, std::memory_order_relaxed);
        return;
      }
    }
  } while (Clock::now() - begin < budget);
  spin_budget_ns_.store(budget.count() / 2, std::memory_order_relaxed);
  auto next_check = Clock::now();
  // A stopped peer is alive but will not move: it fails the wait after stopped_peer_timeout()
  // rather than the operation's time-out (minutes, for peers that are merely slow).
  std::optional<Clock::time_point> stopped_since;
  auto next_stop_check = Clock::now();
  for (;;) {
    if (ready()) return;
    const auto now = Clock::now();
    if (now >= next_check) {
      next_check = now + kCheckInterval;
      if (now >= next_stop_check) {
        // Reading /proc costs ~10 us: every 100 ms is plenty for a limit of seconds.
        next_stop_check = now + std::chrono::milliseconds(100);
        const int pid = controls_[peer].pid.load(std::memory_order_relaxed);
        if (pid != getpid() && process_is_stopped(pid)) {
          if (!stopped_since) stopped_since = now;
          if (now - *stopped_since >= stopped_peer_timeout()) fail_waiting(peer, op, "stopped");
        } else {
          stopped_since.reset();
        }
      }
      if (aborted_.load(std::memory_order_acquire) ||
          header_->abort_rank.load(std::memory_order_acquire) != 0) {
        fail_waiting(peer, op, "aborted");
      }
      if (const int pid = controls_[peer].pid.load(std::memory_order_relaxed);
          pid != getpid() && process_is_gone(pid)) {
        if (ready()) return;  // it finished its part before exiting
        fail_waiting(peer, op, "exited");
      }
      if (now >= op.deadline) fail_waiting(peer, op, "timeout");
    }
    if (now - begin < kYieldTime) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(kSleepTime);
    }
  }
}

}  // namespace shoal::comm::shm
