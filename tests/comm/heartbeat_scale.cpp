// The heartbeat's store traffic as the number of ranks grows, on a real TCP store: at rest one
// request per process per beat whatever its number of groups; while every rank waits, a few
// requests per rank per beat (not one per peer); a rank that stops beating is named by every
// waiter; a rank that is busy but beats is never named.
//
// Each simulated rank is a HangReporter with a TCP client of its own, in this one process (the
// answering thread serves them all, as it serves a process's groups): the code under test is the
// one a rank runs, without a process group or LibTorch work around it.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/hang_reporter.h"
#include "shoal/comm/store.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace heartbeat_scale {

using Clock = std::chrono::steady_clock;

// A real store client that counts the requests sent through it.
class CountingStore : public Store {
 public:
  CountingStore(std::shared_ptr<Store> base, std::atomic<int64_t>& count)
      : base_(std::move(base)), count_(count) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    ++count_;
    base_->set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    ++count_;
    return base_->get(key);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    ++count_;
    return base_->add(key, delta);
  }
  bool check(const std::vector<std::string>& keys) override {
    ++count_;
    return base_->check(keys);
  }
  void wait(const std::vector<std::string>& keys, Milliseconds timeout) override {
    ++count_;
    base_->wait(keys, timeout);
  }
  bool delete_key(const std::string& key) override {
    ++count_;
    return base_->delete_key(key);
  }
  Milliseconds timeout() const override { return base_->timeout(); }
  void set_timeout(Milliseconds timeout) override { base_->set_timeout(timeout); }

 private:
  std::shared_ptr<Store> base_;
  std::atomic<int64_t>& count_;
};

RankSummary nothing_yet() { return {0, 0, "no operation yet"}; }

// `ranks` simulated ranks of one job, each with its world group and `extra_groups` more groups
// spanning the job (as the hierarchical backend's), every group's rank r being job rank r.
struct Job {
  std::shared_ptr<Store> server;
  std::atomic<int64_t> requests{0};
  std::vector<std::shared_ptr<Store>> clients;
  std::vector<std::vector<std::shared_ptr<HangReporter>>> reporters;  // [rank][group]

  Job(int ranks, int extra_groups) {
    const int port = shoal::testing::free_port();
    server = make_tcp_store("127.0.0.1", port, ranks, true, Milliseconds(60'000));
    for (int r = 0; r < ranks; ++r) {
      clients.push_back(std::make_shared<CountingStore>(
          make_tcp_store("127.0.0.1", port, ranks, false, Milliseconds(60'000)), requests));
    }
    reporters.resize(ranks);
    for (int g = 0; g <= extra_groups; ++g) {
      for (int r = 0; r < ranks; ++r) {
        reporters[r].push_back(HangReporter::create(clients[r], "job/g" + std::to_string(g), r,
                                                    ranks, nothing_yet));
      }
    }
  }
  ~Job() {
    for (auto& groups : reporters) {
      for (auto& reporter : groups) reporter->close();
    }
  }
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(HeartbeatScale, AtRestOneRequestPerProcessPerSecondWhateverItsGroups) {
  ::unsetenv("SHOAL_HEARTBEAT_TIMEOUT");  // the default limit: one beat a second
  constexpr int kRanks = 256;
  Job job(kRanks, 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // every reporter has started
  const int64_t before = job.requests.load();
  const auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  const double window = seconds_since(start);
  const double per_rank_second = (job.requests.load() - before) / (window * kRanks);
  std::printf("at rest: %.2f requests per rank per second (3 groups per rank)\n", per_rank_second);
  EXPECT_LE(per_rank_second, 1.05) << "the beat must serve all of a process's groups";
  // Every rank beat meanwhile (so the bound above is not met by silence).
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_GT(job.server->add("shoal/beat/" + std::to_string(r), 0) % kRequestUnit, 0) << r;
  }
}

TEST(HeartbeatScale, EveryWaiterNamesAStoppedRankAndNoneABusyOne) {
  ::setenv("SHOAL_HEARTBEAT_TIMEOUT", "2s", 1);  // beats every 0.5 s
  constexpr int kRanks = 256;
  constexpr int kStopped = 100;
  constexpr Milliseconds kLimit{2000};
  constexpr uint64_t kOperation = 7;
  Job job(kRanks, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));

  // Every rank but 0 (busy elsewhere, yet beating) waits in collective #7 and asks the watch.
  std::vector<std::atomic<int>> named(kRanks);
  for (auto& n : named) n = -2;
  std::atomic<bool> stop{false};
  std::vector<std::thread> waiters;
  for (int r = 1; r < kRanks; ++r) {
    if (r == kStopped) continue;  // it stops below, as a process stopped in its work
    waiters.emplace_back([&, r] {
      while (!stop) {
        if (named[r] == -2) {
          const auto silent = job.reporters[r][0]->silent_ranks(kLimit, kOperation);
          if (!silent.empty()) named[r] = silent.front().rank;
        }
        std::this_thread::sleep_for(kHangPollInterval);
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  const int64_t before = job.requests.load();
  auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));  // longer than the limit
  const double watching = (job.requests.load() - before) / (seconds_since(start) * kRanks);
  std::printf("watching: %.2f requests per rank per second\n", watching);
  // A beat, kWatchedSuccessors readings and one check per beat (0.5 s), a little slack.
  EXPECT_LE(watching, 2.0 * (2 + kWatchedSuccessors) * 1.1) << "the watch must be O(N)";
  for (int r = 1; r < kRanks; ++r) {
    if (r == kStopped) continue;
    EXPECT_EQ(named[r].load(), -2) << "rank " << r << " named rank " << named[r]
                                   << " silent while everyone beats";
  }

  // Rank 100 stops: its reporters go away and its beat stands still.
  for (auto& reporter : job.reporters[kStopped]) reporter->close();
  job.reporters[kStopped].clear();
  start = Clock::now();
  const bool all_named = shoal::testing::wait_until(
      [&] {
        for (int r = 1; r < kRanks; ++r) {
          if (r != kStopped && named[r] == -2) return false;
        }
        return true;
      },
      Milliseconds(30'000));
  const double took = seconds_since(start);
  stop = true;
  for (auto& t : waiters) t.join();
  ASSERT_TRUE(all_named) << "some waiters never learned of the stopped rank";
  std::printf("every waiter named rank %d within %.1f s\n", kStopped, took);
  for (int r = 1; r < kRanks; ++r) {
    if (r != kStopped) EXPECT_EQ(named[r].load(), kStopped) << "rank " << r;
  }
  ::unsetenv("SHOAL_HEARTBEAT_TIMEOUT");
}

}  // namespace heartbeat_scale
}  // namespace shoal::comm
