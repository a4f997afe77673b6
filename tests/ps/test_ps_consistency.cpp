// Consistency and faults, measured on real servers and workers:
// - one worker slowed on purpose: under ssp(s) the staleness the server observes never exceeds s
//   and the fast workers wait (their pull time grows with the slow worker's delay); under asp
//   staleness exceeds s and they do not wait.
// - a worker killed (SIGKILL, a forked process) under asp/ssp: the others finish; the server
//   reports it dead. A killed server: every worker's next step throws naming it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <thread>

#include "ps_testing.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::ps {
namespace test_ps_consistency {

using std::chrono::milliseconds;

constexpr int kSteps = 30;

// After this long without a word from a worker the server presumes it dead: long enough that a
// live worker of a loaded machine is never taken for dead, short enough to keep the tests brisk.
constexpr milliseconds kWorkerTimeout{3000};

// One training step's worth of gradient on random data.
void compute_gradient(testing::TinyNet& net) {
  net->zero_grad();
  torch::nn::functional::cross_entropy(net->forward(torch::randn({4, 8})),
                                       torch::randint(0, 4, {4}, torch::kLong))
      .backward();
}

struct SlowRun {
  ServerStats stats;
  std::vector<double> pull_seconds;  // per worker
  std::vector<double> finish_seconds;
  std::vector<int> slow_steps_at_finish;  // steps worker 2 had completed when each one finished
};

// What worker 2 waits for before its first step: a condition (with a deadline) that a correct
// server reaches whatever the scheduling, so that what the test asserts does not depend on the
// fast workers having been scheduled within the slow worker's delay.
enum class Hold {
  kNothing,
  kFastWorkersDeferred,  // ssp: both fast workers have run ahead and have a pull held back
  kFastWorkersDone,      // asp: both fast workers have finished every step
};

// Three workers; worker 2 sleeps `delay` before each step, after `hold`.
SlowRun run_with_slow_worker(Consistency consistency, int staleness, milliseconds delay,
                             Hold hold = Hold::kNothing) {
  torch::set_num_threads(1);
  constexpr int kWorkers = 3;
  ServerOptions options;
  options.num_workers = kWorkers;
  options.consistency = consistency;
  options.staleness = staleness;
  options.auth_token_from_env = false;
  options.verbose = false;
  testing::ServerSet set(1, options);
  SlowRun run;
  run.pull_seconds.assign(kWorkers, 0);
  run.finish_seconds.assign(kWorkers, 0);
  run.slow_steps_at_finish.assign(kWorkers, 0);
  std::atomic<int> slow_steps{0};
  std::atomic<int> fast_done{0};
  const auto start = std::chrono::steady_clock::now();
  shoal::testing::run_threads(kWorkers, [&](int rank) {
    auto net = testing::make_tiny_net(3);
    Worker worker(testing::worker_options(set, rank, kWorkers), testing::named(*net));
    worker.init();
    const bool slow = rank == kWorkers - 1;
    if (slow && hold == Hold::kFastWorkersDeferred &&
        !shoal::testing::wait_until([&] { return set.servers[0]->stats().deferred_pulls >= 2; },
                                    milliseconds(30000))) {
      throw std::runtime_error("the fast workers were never held back (deferred pulls: " +
                               std::to_string(set.servers[0]->stats().deferred_pulls) + ")");
    }
    if (slow && hold == Hold::kFastWorkersDone &&
        !shoal::testing::wait_until([&] { return fast_done.load() == kWorkers - 1; },
                                    milliseconds(30000))) {
      throw std::runtime_error("the fast workers did not finish while the slow one stood still");
    }
    for (int t = 0; t < kSteps; ++t) {
      if (slow) std::this_thread::sleep_for(delay);
      compute_gradient(net);
      worker.step();
      if (slow) ++slow_steps;
    }
    run.slow_steps_at_finish[rank] = slow_steps.load();
    if (!slow) ++fast_done;
    run.pull_seconds[rank] = worker.pull_seconds();
    run.finish_seconds[rank] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    worker.close();
  }, milliseconds(90000));
  set.join();
  run.stats = set.servers[0]->stats();
  return run;
}

TEST(PsConsistency, SspBoundsStalenessAndFastWorkersWait) {
  const milliseconds delay(20);
  const double slow_total = kSteps * delay.count() / 1000.0;  // 0.6 s
  constexpr int kStaleness = 2;
  const SlowRun ssp =
      run_with_slow_worker(Consistency::kSsp, kStaleness, delay, Hold::kFastWorkersDeferred);
  EXPECT_LE(ssp.stats.max_staleness, kStaleness);
  EXPECT_GT(ssp.stats.deferred_pulls, 0);
  for (int rank : {0, 1}) {
    // Held back to the slow worker's pace: a fast worker's last step needs the slow worker's
    // clock within the bound of its own, and most of the slow worker's sleeping time is spent
    // waiting. (The slow worker's sleeps are lower bounds, and its other work is the fast
    // workers' own: load stretches both sides alike.)
    EXPECT_GE(ssp.slow_steps_at_finish[rank], kSteps - kStaleness - 1) << "worker " << rank;
    EXPECT_GT(ssp.pull_seconds[rank], 0.5 * slow_total) << "worker " << rank;
    EXPECT_GT(ssp.finish_seconds[rank], 0.8 * slow_total) << "worker " << rank;
  }

  // Without a bound the fast workers run ahead: they finish every step while the slow worker has
  // not taken its first (it waits for them; under a bound that wait would fail).
  const SlowRun asp = run_with_slow_worker(Consistency::kAsp, kStaleness, delay,
                                           Hold::kFastWorkersDone);
  EXPECT_GT(asp.stats.max_staleness, kStaleness) << "without a bound the fast workers run ahead";
  EXPECT_EQ(asp.stats.deferred_pulls, 0);
  for (int rank : {0, 1}) {
    EXPECT_EQ(asp.slow_steps_at_finish[rank], 0) << "worker " << rank;
    EXPECT_LT(asp.finish_seconds[rank], asp.finish_seconds[2]) << "worker " << rank;
  }
}

TEST(PsConsistency, BspObservesNoStaleness) {
  const SlowRun bsp = run_with_slow_worker(Consistency::kBsp, 0, milliseconds(2));
  EXPECT_EQ(bsp.stats.max_staleness, 0);
  EXPECT_EQ(bsp.stats.updates, kSteps);
}

// A worker in a forked process, endpoint read from a pipe; killed by the test.
struct PipedWorker {
  int fds[2];
  std::unique_ptr<shoal::testing::ChildProcess> child;
  PipedWorker(int rank, int workers) {
    EXPECT_EQ(::pipe(fds), 0);
    child = std::make_unique<shoal::testing::ChildProcess>([this, rank, workers] {
      char buffer[256] = {};
      ssize_t n = ::read(fds[0], buffer, sizeof(buffer) - 1);
      if (n <= 0) throw std::runtime_error("no endpoint");
      auto net = testing::make_tiny_net(3);
      WorkerOptions options;
      options.servers = {std::string(buffer, static_cast<size_t>(n))};
      options.rank = rank;
      options.num_workers = workers;
      options.auth_token_from_env = false;
      Worker worker(options, testing::named(*net));
      worker.init();
      while (true) {  // trains until killed
        compute_gradient(net);
        worker.step();
      }
    });
  }
  void give_endpoint(const std::string& endpoint) {
    EXPECT_EQ(::write(fds[1], endpoint.data(), endpoint.size()),
              static_cast<ssize_t>(endpoint.size()));
  }
};

void expect_survives_killed_worker(Consistency consistency) {
  torch::set_num_threads(1);
  PipedWorker victim(2, 3);  // forked before any thread of this test starts
  ServerOptions options;
  options.num_workers = 3;
  options.consistency = consistency;
  options.staleness = 1;
  options.auth_token_from_env = false;
  options.worker_timeout = kWorkerTimeout;
  testing::ServerSet set(1, options);
  victim.give_endpoint(set.endpoints()[0]);
  std::atomic<int> steps_done{0};
  shoal::testing::run_threads(2, [&](int rank) {
    auto net = testing::make_tiny_net(3);
    Worker worker(testing::worker_options(set, rank, 3), testing::named(*net));
    worker.init();
    for (int t = 0; t < kSteps; ++t) {
      if (rank == 0 && t == 5) victim.child->kill(SIGKILL);
      compute_gradient(net);
      worker.step();
    }
    steps_done += kSteps;
    worker.close();
  }, milliseconds(30000));
  set.join();
  EXPECT_EQ(steps_done.load(), 2 * kSteps);
  EXPECT_EQ(set.servers[0]->stats().dead_workers, std::vector<int>{2});
}

TEST(PsFaults, AspSurvivesAKilledWorker) { expect_survives_killed_worker(Consistency::kAsp); }
TEST(PsFaults, SspSurvivesAKilledWorker) { expect_survives_killed_worker(Consistency::kSsp); }

TEST(PsFaults, BspNamesTheDeadWorker) {
  torch::set_num_threads(1);
  PipedWorker victim(1, 2);
  ServerOptions options;
  options.num_workers = 2;
  options.consistency = Consistency::kBsp;
  options.auth_token_from_env = false;
  options.worker_timeout = kWorkerTimeout;
  options.verbose = false;
  testing::ServerSet set(1, options);
  victim.give_endpoint(set.endpoints()[0]);
  auto net = testing::make_tiny_net(3);
  Worker worker(testing::worker_options(set, 0, 2), testing::named(*net));
  worker.init();
  compute_gradient(net);
  worker.step();
  victim.child->kill(SIGKILL);
  try {
    for (int t = 0; t < kSteps; ++t) {
      compute_gradient(net);
      worker.step();
    }
    FAIL() << "bsp went on without a worker";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("worker(s) 1 presumed dead"), std::string::npos)
        << e.what();
  }
}

TEST(PsFaults, KilledServerFailsEveryWorkerNamingIt) {
  torch::set_num_threads(1);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  shoal::testing::ChildProcess server_process([&] {
    ServerOptions options;
    options.num_workers = 2;
    options.consistency = Consistency::kAsp;
    options.auth_token_from_env = false;
    Server server(options);
    const std::string endpoint = server.endpoint();
    if (::write(fds[1], endpoint.data(), endpoint.size()) < 0) return;
    server.run();
  });
  char buffer[256] = {};
  const ssize_t n = ::read(fds[0], buffer, sizeof(buffer) - 1);
  ASSERT_GT(n, 0);
  const std::string endpoint(buffer, static_cast<size_t>(n));

  std::vector<std::string> errors(2);
  std::atomic<int> ready{0};
  shoal::testing::run_threads(2, [&](int rank) {
    auto net = testing::make_tiny_net(3);
    WorkerOptions options;
    options.servers = {endpoint};
    options.rank = rank;
    options.num_workers = 2;
    options.auth_token_from_env = false;
    options.timeout = milliseconds(3000);  // a live server of a loaded machine answers within it
    Worker worker(options, testing::named(*net));
    worker.init();
    compute_gradient(net);
    worker.step();
    if (++ready == 2) server_process.kill(SIGKILL);
    const auto start = std::chrono::steady_clock::now();
    try {
      for (int t = 0; t < 1000; ++t) {
        compute_gradient(net);
        worker.step();
      }
    } catch (const PeerError& e) {
      errors[rank] = e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, options.timeout + shoal::testing::kLoadMargin);
  }, milliseconds(30000));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(errors[rank].find("server 0 (" + endpoint + ")"), std::string::npos)
        << "worker " << rank << ": " << errors[rank];
    EXPECT_NE(errors[rank].find("[ps worker " + std::to_string(rank) + "/2]"), std::string::npos)
        << errors[rank];
  }
}

}  // namespace test_ps_consistency
}  // namespace shoal::ps
