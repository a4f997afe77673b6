// The heartbeat's store traffic at 256 simulated ranks (HeartbeatSimulation: real reporters, a
// real TCP store): at rest one request per process per beat whatever its number of groups; while
// every rank waits, a few requests per rank per beat, not one per peer; a rank that stops beating
// is named by every waiter; a rank that is busy but beats is never named; a report that every
// rank asks for at once costs O(N) requests, not one per pair of ranks.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
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

// Waits until every rank has beaten at least once (its reporter runs), for up to 30 s.
bool every_rank_beats(HeartbeatSimulation& job) {
  return shoal::testing::wait_until(
      [&] {
        for (int r = 0; r < job.ranks(); ++r) {
          if (job.beats(r) == 0) return false;
        }
        return true;
      },
      Milliseconds(30'000));
}

TEST(HeartbeatScale, AtRestOneRequestPerProcessPerSecondWhateverItsGroups) {
  ::unsetenv("SHOAL_HEARTBEAT_TIMEOUT");  // the default limit: one beat a second
  HeartbeatSimulation job(kRanks, 3);
  ASSERT_TRUE(every_rank_beats(job)) << "a rank never beat";
  const double rate = request_rate(job, Milliseconds(3000));
  std::printf("at rest: %.2f requests per rank per second (3 groups per rank)\n", rate);
  EXPECT_LE(rate, 1.05) << "one beat must serve all of a process's groups";
}

TEST(HeartbeatScale, EveryWaiterNamesAStoppedRankAndNoneABusyOne) {
  ::setenv("SHOAL_HEARTBEAT_TIMEOUT", "2s", 1);  // beats every 0.5 s
  constexpr int kStopped = 100;
  HeartbeatSimulation job(kRanks, 1);
  ASSERT_TRUE(every_rank_beats(job)) << "a rank never beat";
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

// How many times `text` holds `what`.
int occurrences(const std::string& text, const std::string& what) {
  int count = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++count;
  return count;
}

TEST(HeartbeatScale, EveryRankAskingForAReportAtOnceCostsLinearRequests) {
  ::unsetenv("SHOAL_HEARTBEAT_TIMEOUT");
  HeartbeatSimulation job(kRanks, 1);
  ASSERT_TRUE(every_rank_beats(job)) << "a rank never beat";
  const int64_t before = job.requests();
  const std::vector<std::string> tables = job.gather_all(kHangReportBudget);
  const int64_t requests = job.requests() - before;
  std::printf("%d ranks asking at once: %lld requests (%.1f per rank)\n", kRanks,
              static_cast<long long>(requests), double(requests) / kRanks);
  // Per asking rank: a dozen rounds of three requests in the budget, its question and its answer.
  // Asking every other rank through its beat counter, as each asker once did, alone costs N(N-1).
  EXPECT_LE(requests, 64 * kRanks) << "a report's requests must not grow with N per asking rank";
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(occurrences(tables[r], "no operation yet"), kRanks) << "rank " << r << ":" << tables[r];
  }

}

TEST(HeartbeatScale, AReportNamesAStoppedRankAndHasEveryOtherRanksLine) {
  ::setenv("SHOAL_HEARTBEAT_TIMEOUT", "1s", 1);  // beats every 0.25 s: asked ranks answer soon
  constexpr int kFew = 8;
  HeartbeatSimulation job(kFew, 1);
  job.stop(5);
  const std::string table = job.gather(3, Milliseconds(2000));
  EXPECT_NE(table.find("rank 5: no report (dead or stopped?)"), std::string::npos) << table;
  EXPECT_EQ(occurrences(table, "no operation yet"), kFew - 1) << table;
  ::unsetenv("SHOAL_HEARTBEAT_TIMEOUT");
}

}  // namespace heartbeat_scale
}  // namespace shoal::comm
