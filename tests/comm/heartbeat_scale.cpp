// The heartbeat's store traffic at 256 simulated ranks (HeartbeatSimulation: real reporters, a
// real TCP store): at rest one request per process per beat whatever its number of groups; while
// every rank waits, a few requests per rank per beat, not one per peer; a rank that stops beating
// is named by every waiter; a rank that is busy but beats is never named.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/heartbeat_simulation.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace heartbeat_scale {

using Clock = std::chrono::steady_clock;
constexpr int kRanks = 256;

// Store requests per rank and second over the next `window`.
double request_rate(const HeartbeatSimulation& job, Milliseconds window) {
  const int64_t before = job.requests();
  const auto start = Clock::now();
  std::this_thread::sleep_for(window);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return (job.requests() - before) / (seconds * job.ranks());
}

TEST(HeartbeatScale, AtRestOneRequestPerProcessPerSecondWhateverItsGroups) {
  ::unsetenv("SHOAL_HEARTBEAT_TIMEOUT");  // the default limit: one beat a second
  HeartbeatSimulation job(kRanks, 3);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // every reporter has started
  const double rate = request_rate(job, Milliseconds(3000));
  std::printf("at rest: %.2f requests per rank per second (3 groups per rank)\n", rate);
  EXPECT_LE(rate, 1.05) << "one beat must serve all of a process's groups";
  for (int r = 0; r < kRanks; ++r) EXPECT_GT(job.beats(r), 0) << "rank " << r << " never beat";
}

TEST(HeartbeatScale, EveryWaiterNamesAStoppedRankAndNoneABusyOne) {
  ::setenv("SHOAL_HEARTBEAT_TIMEOUT", "2s", 1);  // beats every 0.5 s
  constexpr int kStopped = 100;
  HeartbeatSimulation job(kRanks, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  // Every rank but 0 (busy elsewhere, yet beating) waits in collective #7.
  job.start_waiting(0, 7, Milliseconds(2000));
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  const double rate = request_rate(job, Milliseconds(3000));  // longer than the limit
  std::printf("watching: %.2f requests per rank per second\n", rate);
  // Per beat (0.5 s): the beat, kWatchedSuccessors readings and one check; a little slack.
  EXPECT_LE(rate, 2.0 * (2 + kWatchedSuccessors) * 1.1) << "the watch must be O(N)";
  EXPECT_EQ(job.naming(), 0) << "a waiter named a rank silent while every rank beats";

  job.stop(kStopped);
  const auto start = Clock::now();
  const bool all = shoal::testing::wait_until([&] { return job.naming() == kRanks - 2; },
                                              Milliseconds(30'000));
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  job.stop_waiting();
  ::unsetenv("SHOAL_HEARTBEAT_TIMEOUT");
  ASSERT_TRUE(all) << job.naming() << " of " << kRanks - 2 << " waiters named a silent rank";
  std::printf("every waiter named rank %d within %.1f s\n", kStopped, took);
  for (int r = 1; r < kRanks; ++r) {
    if (r != kStopped) EXPECT_EQ(job.named(r), kStopped) << "rank " << r;
  }
}

}  // namespace heartbeat_scale
}  // namespace shoal::comm
