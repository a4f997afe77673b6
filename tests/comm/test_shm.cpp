// The shm backend beyond the shared collective tests: ranks as processes, dead and late peers,
// nothing left in /dev/shm, large and chunk-straddling messages, float16/bfloat16 accuracy, and
// the hierarchical backend over two pretended hosts.
#include <gtest/gtest.h>

#include <future>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <torch/torch.h>

#include <chrono>
#include <atomic>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include "comm/hierarchical/process_group_hierarchical.h"
#include "comm/shm/op_queue.h"
#include "comm/shm/process_group_shm.h"
#include "comm/shm/shared_segment.h"
#include "comm/timeouts.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace test_shm {

using shoal::testing::run_processes;
using shoal::testing::run_threads;

// Tests that straddle chunk boundaries set a small chunk (SHOAL_SHM_CHUNK_BYTES), so that small
// tensors span many chunks; this is it in float32 elements.
constexpr int64_t kChunkFloats = (64 << 10) / 4;

// Sets SHOAL_SHM_CHUNK_BYTES for the groups a test creates (threads share the environment).
class SmallChunks {
 public:
  SmallChunks() { setenv("SHOAL_SHM_CHUNK_BYTES", "65536", 1); }
  ~SmallChunks() { unsetenv("SHOAL_SHM_CHUNK_BYTES"); }
};

std::string messages(const std::vector<shoal::testing::ProcessResult>& results) {
  std::string out;
  for (const auto& r : results) {
    out += "rank " + std::to_string(r.rank) + ": exit " + std::to_string(r.exit_code) +
           " signal " + std::to_string(r.signal) + " " + r.error + "\n";
  }
  return out;
}

// Rank r's deterministic input: small integers, exact in every dtype tested.
torch::Tensor input(int rank, int64_t numel, torch::Dtype dtype = torch::kFloat) {
  return (torch::arange(numel, torch::kLong).remainder(7) + rank).to(dtype);
}

torch::Tensor expected_sum(int world, int64_t numel, torch::Dtype dtype = torch::kFloat) {
  auto sum = torch::zeros({numel}, torch::kLong);
  for (int r = 0; r < world; ++r) sum += input(r, numel, torch::kLong);
  return sum.to(dtype);
}

// A thread that waits for a task the worker has not started runs it itself, with every task
// queued before it, in order; the worker runs the rest; every Work completes.
TEST(ShmSegments, NamesOfDeadCreatorsAreReclaimed) {
  // A creator killed between shm_open and every rank's mmap leaves its name behind: make one for
  // real (a child that creates a segment and is SIGKILLed), and one of this live process.
  const pid_t child = ::fork();
  if (child == 0) {
    auto segment = shm::SharedSegment::create("/shoal-" + std::to_string(::getpid()) + "-test", 4096);
    ::raise(SIGKILL);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  const std::string dead = "/dev/shm/shoal-" + std::to_string(child) + "-test";
  const std::string live = "/dev/shm/shoal-" + std::to_string(::getpid()) + "-test";
  ASSERT_TRUE(std::filesystem::exists(dead)) << "the killed creator's name should be left behind";
  std::FILE* f = std::fopen(live.c_str(), "w");  // a live process's name, not to be touched
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  EXPECT_GE(shm::SharedSegment::reclaim_dead_segments(), 1);
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(live));
  EXPECT_EQ(shm::SharedSegment::remove_segments_of({static_cast<int>(::getpid())}), 1);
  EXPECT_FALSE(std::filesystem::exists(live));
}

TEST(ShmOpQueue, WaiterRunsItsQueuedTaskInOrder) {
  auto queue = std::make_shared<shm::OpQueue>("test");
  std::mutex mutex;
  std::vector<int> order;
  std::vector<std::thread::id> ran_on(6);
  std::vector<std::shared_ptr<shm::ShmWork>> works;
  // The first task holds the worker, so the next ones are still queued when waited for.
  std::atomic<bool> started{false}, release{false};
  for (int i = 0; i < 6; ++i) {
    OpLabel label;
    label.name = "task";
    label.sequence = static_cast<uint64_t>(i + 1);
    auto work = std::make_shared<shm::ShmWork>(label, Milliseconds(10'000), queue);
    queue->enqueue(
        [&, i, work] {
          if (i == 0) {
            started = true;
            while (!release.load()) std::this_thread::yield();
          }
          {
            std::lock_guard<std::mutex> lock(mutex);
            order.push_back(i);
            ran_on[i] = std::this_thread::get_id();
          }
          work->finish();
        },
        work.get());
    works.push_back(work);
  }
  // While task 0 runs on the worker nobody else may run a task: this wait cannot help, so it
  // must still be waiting when task 0 is released.
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!started.load() && std::chrono::steady_clock::now() < limit) std::this_thread::yield();
  ASSERT_TRUE(started.load()) << "the worker never started the first task";
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    release = true;
  });
  works[0]->wait();
  releaser.join();
  // Tasks 1..3 are (most likely) still queued: waiting for 3 runs 1, 2, 3 here, or the worker
  // has taken some; either way in order.
  works[3]->wait();
  for (auto& work : works) work->wait();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_NE(ran_on[0], std::this_thread::get_id());  // the worker ran the one it had started
  queue->stop();
  queue->stop();  // idempotent
}

// Through the group: collectives issued back to back and waited for in reverse order (a waiter
// helping with the queue) give the same results on every rank as waiting in order.
TEST(ShmOpQueue, ReverseWaitsThroughTheGroup) {
  SmallChunks chunks;  // 64 KiB chunks: every tensor below is queued, not run inline
  auto store = make_hash_store(Milliseconds(30'000));
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2, Milliseconds(30'000));
    for (int round = 0; round < 20; ++round) {
      std::vector<torch::Tensor> tensors;
      std::vector<std::shared_ptr<Work>> works;
      for (int i = 0; i < 5; ++i) {
        tensors.push_back(input(rank, kChunkFloats * 2 + i));
        works.push_back(pg->allreduce(tensors.back()));
      }
      for (int i = 4; i >= 0; --i) works[i]->wait();
      for (int i = 0; i < 5; ++i) {
        ASSERT_TRUE(torch::equal(tensors[i], expected_sum(2, kChunkFloats * 2 + i)))
            << "round " << round << " tensor " << i;
      }
    }
  });
}

// async_op = false on a collective too large to run inline by default: the call itself runs it (on
// the calling thread) and throws what goes wrong, a rank that never comes here named in it.
TEST(ShmBlockingCalls, AFailureIsThrownByTheCallItself) {
  auto store = make_hash_store(Milliseconds(30'000));
  std::atomic<bool> thrown{false};
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2, Milliseconds(30'000));
    if (rank == 1) {
      const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (!thrown.load() && std::chrono::steady_clock::now() < limit) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      return;
    }
    auto t = torch::ones({1 << 18});  // 1 MiB: above the inline size, so queued unless blocking
    AllreduceOptions options;
    options.async_op = false;
    options.timeout = Milliseconds(300);
    try {
      pg->allreduce(t, options);
      ADD_FAILURE() << "allreduce(async_op=false) returned without its peer";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("allreduce"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    }
    thrown = true;
  });
  EXPECT_TRUE(thrown.load());
}

// async_op = false on collectives far above the inline size: each runs on the calling thread (no
// hand-off to the group's worker), counted by the group; the same calls asynchronous are queued.
TEST(ShmBlockingCalls, RunOnTheCallingThread) {
  auto store = make_hash_store(Milliseconds(30'000));
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2, Milliseconds(30'000));
    auto* shm = dynamic_cast<shm::ProcessGroupShm*>(pg.get());
    ASSERT_NE(shm, nullptr) << pg->backend_name();
    const int64_t numel = 1 << 18;  // 1 MiB of floats: far above the 32 KiB inline size
    // Blocking calls first: nothing has been queued on this group, so none waits behind another.
    const uint64_t before = shm->collectives_run_inline();
    auto sum = input(rank, numel);
    AllreduceOptions reduce_options;
    reduce_options.async_op = false;
    auto work = pg->allreduce(sum, reduce_options);
    EXPECT_TRUE(work->is_completed());
    EXPECT_TRUE(torch::equal(sum, expected_sum(2, numel)));
    auto mine = input(rank, numel / 2);
    auto gathered = torch::empty({numel});
    AllgatherOptions gather_options;
    gather_options.async_op = false;
    pg->all_gather_into_tensor(gathered, mine, gather_options);
    EXPECT_TRUE(torch::equal(gathered, torch::cat({input(0, numel / 2), input(1, numel / 2)})));
    auto full = input(rank, numel);
    auto block = torch::empty({numel / 2});
    ReduceScatterOptions scatter_options;
    scatter_options.async_op = false;
    pg->reduce_scatter_tensor(block, full, scatter_options);
    EXPECT_TRUE(torch::equal(block, expected_sum(2, numel).narrow(0, rank * (numel / 2), numel / 2)));
    auto root = input(rank, numel);
    BroadcastOptions broadcast_options;
    broadcast_options.root = 1;
    broadcast_options.async_op = false;
    pg->broadcast(root, broadcast_options);
    EXPECT_TRUE(torch::equal(root, input(1, numel)));
    EXPECT_EQ(shm->collectives_run_inline(), before + 4);
    // The same sizes asynchronous go to the worker thread.
    auto queued = input(rank, numel);
    pg->allreduce(queued)->wait();
    EXPECT_TRUE(torch::equal(queued, expected_sum(2, numel)));
    EXPECT_EQ(shm->collectives_run_inline(), before + 4);
  });
}

TEST(ShmProcesses, CollectivesAcrossProcesses) {
  for (int world = 2; world <= 4; ++world) {
    auto results = run_processes(world, [world](int rank, const std::string& path) {
      SmallChunks small;
      auto store = make_file_store(path, world, Milliseconds(20'000));
      auto pg = new_process_group("shm", store, rank, world, Milliseconds(20'000));
      SHOAL_CHECK(pg->backend_name() == "shm", "backend is ", pg->backend_name());
      for (int64_t numel : {int64_t{1}, int64_t{1001}, 3 * kChunkFloats + 5}) {
        auto t = input(rank, numel);
        pg->allreduce(t)->wait();
        SHOAL_CHECK(torch::equal(t, expected_sum(world, numel)), "allreduce of ", numel);
        auto b = input(rank, numel);
        pg->broadcast(b, {world - 1})->wait();
        SHOAL_CHECK(torch::equal(b, input(world - 1, numel)), "broadcast of ", numel);
      }
      pg->barrier()->wait();
    });
    for (const auto& r : results) EXPECT_TRUE(r.ok()) << "world " << world << "\n" << messages(results);
  }
}

// Creator pids of shoal segments in /dev/shm ("shoal-<pid>-<random>").
std::set<std::string> shm_entries() {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("shoal-", 0) == 0) out.insert(name);
  }
  return out;
}

bool creator_alive(const std::string& entry) {
  const int pid = std::atoi(entry.c_str() + 6);
  return pid > 0 && kill(pid, 0) == 0;
}

TEST(ShmFaults, KilledRankIsNamedAndNothingLeaks) {
  const auto before = shm_entries();
  const Milliseconds timeout(4'000);
  auto results = run_processes(3, [&](int rank, const std::string& path) {
    auto store = make_file_store(path, 3, timeout);
    auto pg = new_process_group("shm", store, rank, 3, timeout);
    auto t = torch::ones({1 << 20});
    pg->allreduce(t)->wait();  // everyone is up and has mapped the segment
    if (rank == 1) raise(SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    pg->allreduce(t)->wait();
  });
  ASSERT_EQ(results[1].signal, SIGKILL) << messages(results);
  for (int rank : {0, 2}) {
    const auto& r = results[rank];
    EXPECT_FALSE(r.ok()) << messages(results);
    EXPECT_NE(r.error.find("rank 1 (pid"), std::string::npos) << r.error;
    EXPECT_NE(r.error.find("allreduce #"), std::string::npos) << r.error;
    EXPECT_LT(r.seconds, shoal::testing::fault_deadline_seconds(timeout)) << r.error;
    std::cout << "rank " << rank << " reported: " << r.error << "\n";
  }
  // A segment left behind would belong to a job whose creator is gone.
  for (const auto& entry : shm_entries()) {
    if (before.count(entry) == 0) EXPECT_TRUE(creator_alive(entry)) << "leaked /dev/shm/" << entry;
  }
}

TEST(ShmFaults, StoppedRankIsNamedInSecondsSlowRankIsWaitedFor) {
  // Dead or stopped is not slow: rank 1 first computes for longer than kStoppedPeerTimeout (it is
  // waited for: the time-out is 60 s), then stops itself with SIGSTOP: rank 0 fails within
  // seconds, naming it, long before the time-out.
  const Milliseconds timeout(60'000);
  const double slow_s = kStoppedPeerTimeout.count() / 1000.0 + 1.5;
  auto results = run_processes(2, [&](int rank, const std::string& path) {
    auto store = make_file_store(path, 2, Milliseconds(20'000));
    auto pg = new_process_group("shm", store, rank, 2, timeout);
    auto t = torch::ones({1024});
    pg->allreduce(t)->wait();
    if (rank == 1) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(slow_s);
      while (std::chrono::steady_clock::now() < until) {
      }  // busy: a rank evaluating
    }
    pg->allreduce(t)->wait();  // rank 0 waits here for the slow rank 1, and must succeed
    SHOAL_CHECK(t[0].item<float>() == 4.0f, "wrong sum");
    if (rank == 1) {
      store->set_string("pid1", std::to_string(getpid()));
      raise(SIGSTOP);
      return;
    }
    const pid_t stopped = static_cast<pid_t>(std::stol(store->get_string("pid1")));
    try {
      pg->allreduce(t)->wait();
    } catch (...) {
      ::kill(stopped, SIGKILL);  // the test is over: do not leave it stopped
      throw;
    }
    ::kill(stopped, SIGKILL);
  }, Milliseconds(40'000));
  const auto& r0 = results[0];
  EXPECT_FALSE(r0.ok()) << messages(results);
  EXPECT_NE(r0.error.find("rank 1 (pid"), std::string::npos) << r0.error;
  EXPECT_NE(r0.error.find("stopped"), std::string::npos) << r0.error;
  EXPECT_NE(r0.error.find("allreduce #"), std::string::npos) << r0.error;
  // slow_s of waiting for the slow rank, then about kStoppedPeerTimeout for the stopped one.
  EXPECT_LT(r0.seconds, slow_s + kStoppedPeerTimeout.count() / 1000.0 + 6.0) << r0.error;
  std::cout << "rank 0 reported after " << r0.seconds << " s: " << r0.error << "\n";
}

TEST(ShmFaults, LateRankTimesOutNamingIt) {
  auto store = make_hash_store(Milliseconds(10'000));
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 comes late by a handshake, not a sleep: only after rank 0 has timed out.
  std::promise<void> rank0_gave_up;
  auto gave_up = rank0_gave_up.get_future();
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2, Milliseconds(10'000));
    if (rank == 1 && gave_up.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
      throw std::runtime_error("rank 0 never gave up on rank 1");
    }
    auto t = torch::ones({100});
    try {
      pg->allreduce(t, {ReduceOp::kSum, Milliseconds(300)})->wait();
    } catch (const Error& e) {
      errors[rank] = e.what();
    }
    if (rank == 0) rank0_gave_up.set_value();
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(errors[0].find("[rank 0/2] allreduce #1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("timed out after"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("waiting for rank 1"), std::string::npos) << errors[0];
  // The late rank learns at once that the group is gone, and why.
  EXPECT_NE(errors[1].find("rank 0 aborted the group"), std::string::npos) << errors[1];
  EXPECT_LT(seconds, shoal::testing::fault_deadline_seconds(Milliseconds(300)));
  std::cout << "rank 0 reported: " << errors[0] << "\nrank 1 reported: " << errors[1] << "\n";
}

TEST(ShmLarge, SixtyFourMebibytes) {
  auto store = make_hash_store();
  const int64_t numel = (64 << 20) / 4;
  const auto base = torch::arange(numel, torch::kFloat).remainder_(7);  // exact in float32
  const auto expected = base * 2 + 1;                                    // ranks add 0 and 1
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2);
    auto t = base + rank;
    pg->allreduce(t)->wait();
    ASSERT_TRUE(torch::equal(t, expected));
  });
}

TEST(ShmChunks, SizesAroundChunkBoundaries) {
  SmallChunks small;
  auto store = make_hash_store();
  run_threads(3, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 3);
    for (int64_t numel : {kChunkFloats - 1, kChunkFloats + 1, 2 * kChunkFloats, 5 * kChunkFloats + 3}) {
      for (auto dtype : {torch::kFloat, torch::kLong, torch::kHalf, torch::kByte}) {
        auto t = input(rank, numel, dtype);
        pg->allreduce(t)->wait();
        ASSERT_TRUE(torch::equal(t, expected_sum(3, numel, dtype))) << numel << " " << dtype;
        auto m = input(rank, numel, dtype);
        pg->allreduce(m, {ReduceOp::kMax})->wait();
        ASSERT_TRUE(torch::equal(m, input(2, numel, dtype))) << numel << " " << dtype;
        std::vector<torch::Tensor> outs;
        for (int r = 0; r < 3; ++r) outs.push_back(torch::empty({numel}, dtype));
        pg->allgather(outs, input(rank, numel, dtype))->wait();
        for (int r = 0; r < 3; ++r) ASSERT_TRUE(torch::equal(outs[r], input(r, numel, dtype)));
        std::vector<torch::Tensor> ins;
        for (int r = 0; r < 3; ++r) ins.push_back(input(rank + r, numel, dtype));
        auto out = torch::empty({numel}, dtype);
        pg->reduce_scatter(out, ins)->wait();
        auto want = (input(rank, numel, torch::kLong) * 3 + 3).to(dtype);  // ranks 0,1,2 + rank
        ASSERT_TRUE(torch::equal(out, want)) << numel << " " << dtype;
      }
    }
  });
}

TEST(ShmAccuracy, HalfAndBFloat16AgainstFloat64) {
  SmallChunks small;
  const int world = 4;
  for (int64_t numel : {int64_t{1000}, 3 * kChunkFloats + 11}) {
    for (auto dtype : {torch::kHalf, torch::kBFloat16}) {
      std::vector<torch::Tensor> results(world), inputs(world);
      for (int r = 0; r < world; ++r) {
        torch::manual_seed(100 + r);
        inputs[r] = torch::randn({numel}).to(dtype);
      }
      auto store = make_hash_store();
      run_threads(world, [&](int rank) {
        auto pg = new_process_group("shm", store, rank, world);
        auto t = inputs[rank].clone();
        pg->allreduce(t)->wait();
        results[rank] = t;
      });
      auto reference = torch::zeros({numel}, torch::kDouble);
      for (const auto& x : inputs) reference += x.to(torch::kDouble);
      // Accumulated in float32 and rounded once: within half a unit in the last place.
      const double eps = dtype == torch::kHalf ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
      const auto error = (results[0].to(torch::kDouble) - reference).abs();
      const auto bound = reference.abs() * (eps / 2) * 1.0001 + 1e-5;
      EXPECT_TRUE(torch::all(error <= bound).item<bool>())
          << c10::toString(dtype) << " numel " << numel << " max error "
          << error.max().item<double>();
      for (int r = 1; r < world; ++r) {
        EXPECT_TRUE(torch::equal(results[r], results[0])) << "rank " << r << " differs";
      }
    }
  }
}

// ---- symmetric memory (empty_symmetric) ---------------------------------------------------------

// Fills `t` (a symmetric tensor) with rank r's input and allreduces it in place, against the
// expected sums, across real processes; ordinary tensors in between must keep working.
TEST(ShmSymmetric, AllreduceInPlaceAcrossProcesses) {
  // hierarchical on one host hands symmetric memory to its shm group.
  for (auto [backend, world] : {std::pair<const char*, int>{"shm", 2}, {"shm", 3}, {"hierarchical", 2}}) {
    auto results = run_processes(world, [world, backend](int rank, const std::string& path) {
      auto store = make_file_store(path, world, Milliseconds(20'000));
      auto pg = new_process_group(backend, store, rank, world, Milliseconds(20'000));
      for (int64_t numel : {int64_t{1}, int64_t{1001}, int64_t{(1 << 18) + 3}}) {
        for (auto dtype : {torch::kFloat, torch::kLong, torch::kHalf}) {
          auto a = pg->empty_symmetric(numel, dtype);
          auto b = pg->empty_symmetric(numel, dtype);
          SHOAL_CHECK(pg->is_symmetric(a) && pg->is_symmetric(b), "not symmetric");
          SHOAL_CHECK(!pg->is_symmetric(torch::zeros({numel}, dtype)), "ordinary is symmetric");
          for (int iteration = 0; iteration < 3; ++iteration) {
            a.copy_(input(rank + iteration, numel, dtype));
            b.copy_(input(rank, numel, dtype));
            auto plain = input(rank, numel, dtype);
            // Queued back to back: in order, each in its own region.
            auto wa = pg->allreduce(a);
            auto wp = pg->allreduce(plain);
            auto wb = pg->allreduce(b, {ReduceOp::kMax});
            wa->wait();
            wp->wait();
            wb->wait();
            auto want = (expected_sum(world, numel, torch::kLong) + world * iteration).to(dtype);
            SHOAL_CHECK(torch::equal(a, want), "symmetric sum wrong: ", numel, " ", dtype);
            SHOAL_CHECK(torch::equal(plain, expected_sum(world, numel, dtype)), "plain sum wrong");
            SHOAL_CHECK(torch::equal(b, input(world - 1, numel, dtype)), "symmetric max wrong");
          }
          if (dtype == torch::kFloat) {
            a.copy_(input(rank, numel, dtype));
            pg->allreduce(a, {ReduceOp::kAvg})->wait();
            SHOAL_CHECK(torch::allclose(a, expected_sum(world, numel, torch::kDouble)
                                               .div(world).to(dtype)),
                        "symmetric avg wrong");
          }
        }
      }
    });
    for (const auto& r : results) ASSERT_EQ(r.exit_code, 0) << backend << "\n" << messages(results);
  }
}

// Averaging (DDP's buckets) on 2 ranks is one pass that halves the sum: bit for bit
// (a + b) / 2 in float32 (what the generic kernel gives: the sum, then the division), on values
// that reach subnormals and overflow, on the direct and the chunked paths (ordinary tensors) and
// the symmetric one, with a length that leaves a vector tail.
TEST(ShmAllreduce, TwoRankAverageIsTheSumHalvedBitForBit) {
  auto store = make_hash_store();
  std::vector<std::string> failures(2);
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2, Milliseconds(20'000));
    for (int64_t numel : {int64_t{1003}, int64_t{(1 << 19) + 5}}) {
      auto values = [&](int r) {
        auto g = at::make_generator<at::CPUGeneratorImpl>(numel * 7 + r);
        auto x = at::randn({numel}, g, torch::TensorOptions().dtype(torch::kFloat));
        // A spread of magnitudes: subnormal results, overflowing sums, ordinary ones.
        auto exponent = at::randint(-135, 128, {numel}, g, torch::TensorOptions().dtype(torch::kFloat));
        return x.mul(at::pow(2.0, exponent)).clamp(-3.4e38, 3.4e38);
      };
      const auto mine = values(rank);
      const auto want = (values(0) + values(1)) / 2;
      auto plain = mine.clone();
      pg->allreduce(plain, {ReduceOp::kAvg})->wait();
      auto symmetric = pg->empty_symmetric(numel, torch::kFloat).copy_(mine);
      pg->allreduce(symmetric, {ReduceOp::kAvg})->wait();
      for (const auto& [name, got] : {std::pair{"plain", plain}, std::pair{"symmetric", symmetric}}) {
        // equal() with NaN nowhere: inf stays inf; compare the bits.
        if (!torch::equal(got.view(torch::kInt), want.view(torch::kInt))) {
          const auto differ = got.view(torch::kInt).ne(want.view(torch::kInt)).sum().item<int64_t>();
          failures[rank] += std::string(name) + " numel " + std::to_string(numel) + ": " +
                            std::to_string(differ) + " elements differ; ";
        }
      }
    }
  });
  EXPECT_EQ(failures[0], "");
  EXPECT_EQ(failures[1], "");
}

TEST(ShmSymmetric, RanksThatDisagreeAboutTheTensorFailClearly) {
  auto store = make_hash_store();
  std::vector<std::string> errors(2);
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2, Milliseconds(10'000));
    auto symmetric = pg->empty_symmetric(4096, torch::kFloat).fill_(1);
    auto ordinary = torch::ones({4096});
    try {
      pg->allreduce(rank == 0 ? symmetric : ordinary)->wait();
    } catch (const Error& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("rank 1 passed an ordinary tensor"), std::string::npos) << errors[0];
  EXPECT_FALSE(errors[1].empty()) << "rank 1 must fail too, not hang or succeed";
}

// all_gather_into_tensor into a tensor of empty_symmetric(), or from one (FSDP's shards), copies
// the peers' blocks straight from their slots: the same result as between ordinary tensors, with
// the input anywhere or already in this rank's block, queued back to back with ordinary ones.
// Gathers of up to 64 KiB in all are staged as ordinary ones are: fewer rounds.
TEST(ShmSymmetric, AllGatherIntoASymmetricTensor) {
  for (int world : {2, 3}) {
    auto store = make_hash_store();
    std::vector<std::string> failures(world);
    run_threads(world, [&](int rank) {
      auto pg = new_process_group("shm", store, rank, world, Milliseconds(20'000));
      for (int64_t numel : {int64_t{1}, int64_t{1001}, int64_t{(1 << 18) + 3}}) {
        auto full = pg->empty_symmetric(numel * world, torch::kFloat);
        auto plain = torch::empty({numel * world});
        auto from = torch::empty({numel * world});
        auto shard = pg->empty_symmetric(numel, torch::kFloat);
        auto want = torch::arange(numel * world, torch::kFloat);
        for (int iteration = 0; iteration < 3; ++iteration) {
          full.fill_(-1);
          auto mine = want.narrow(0, rank * numel, numel) + iteration;
          // Iteration 1: the input is this rank's own block of the output.
          auto in = iteration == 1 ? full.narrow(0, rank * numel, numel).copy_(mine) : mine.clone();
          shard.copy_(mine);
          auto wf = pg->all_gather_into_tensor(full, in);
          auto wp = pg->all_gather_into_tensor(plain, mine);
          auto ws = pg->all_gather_into_tensor(from, shard);
          wf->wait();
          wp->wait();
          ws->wait();
          if (!torch::equal(full, want + iteration) || !torch::equal(plain, want + iteration) ||
              !torch::equal(from, want + iteration)) {
            failures[rank] += "numel " + std::to_string(numel) + " iteration " +
                              std::to_string(iteration) + " wrong; ";
          }
        }
      }
    });
    for (int rank = 0; rank < world; ++rank) EXPECT_EQ(failures[rank], "") << "world " << world;
  }
}

TEST(ShmSymmetric, AllGatherRanksThatDisagreeAboutTheOutputFailClearly) {
  auto store = make_hash_store();
  std::vector<std::string> errors(2);
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2, Milliseconds(10'000));
    // Above 64 KiB in all: smaller gathers are staged whatever the tensors.
    const int64_t numel = (1 << 18) + 16;
    auto symmetric = pg->empty_symmetric(2 * numel, torch::kFloat);
    auto ordinary = torch::empty({2 * numel});
    try {
      pg->all_gather_into_tensor(rank == 0 ? symmetric : ordinary, torch::ones({numel}))->wait();
    } catch (const Error& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("rank 1 passed an ordinary tensor"), std::string::npos) << errors[0];
  EXPECT_FALSE(errors[1].empty()) << "rank 1 must fail too, not hang or succeed";
}

// reduce_scatter_tensor from an input in empty_symmetric() (FSDP's stage-1 flat gradients) reduces
// each rank's block straight from every rank's slot: bit for bit the staged result on ordinary
// tensors (the same sums in the same order), in float and half, sum and average, an input that
// is part of a larger symmetric tensor, queued back to back with ordinary ones; up to 64 KiB in
// all both are staged.
TEST(ShmSymmetric, ReduceScatterFromASymmetricInput) {
  for (int world : {2, 3}) {
    auto store = make_hash_store();
    std::vector<std::string> failures(world);
    run_threads(world, [&](int rank) {
      auto pg = new_process_group("shm", store, rank, world, Milliseconds(20'000));
      for (int64_t numel : {int64_t{1}, int64_t{5000}, int64_t{(1 << 18) + 3}}) {
        for (auto dtype : {torch::kFloat, torch::kHalf}) {
          for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
            // One element before the input: the input starts inside the region, not at its start.
            auto region = pg->empty_symmetric(numel * world + 1, dtype);
            auto input = region.narrow(0, 1, numel * world);
            auto plain = torch::empty({numel * world}, dtype);
            for (int iteration = 0; iteration < 2; ++iteration) {
              auto values = torch::randn({numel * world}, torch::TensorOptions().dtype(torch::kFloat)
                                                              .requires_grad(false))
                                .mul_(rank + 1 + iteration)
                                .to(dtype);
              input.copy_(values);
              plain.copy_(values);
              auto out_symmetric = torch::empty({numel}, dtype);
              auto out_plain = torch::empty({numel}, dtype);
              auto ws = pg->reduce_scatter_tensor(out_symmetric, input, {op});
              auto wp = pg->reduce_scatter_tensor(out_plain, plain, {op});
              ws->wait();
              wp->wait();
              if (!torch::equal(out_symmetric, out_plain)) {
                failures[rank] += "numel " + std::to_string(numel) + " differs; ";
              }
              // Against the sum itself (every rank's values, gathered).
              auto all = torch::empty({numel * world * world}, dtype);
              pg->all_gather_into_tensor(all, values)->wait();
              auto want = all.view({world, world, numel}).to(torch::kDouble).sum(0)[rank];
              if (op == ReduceOp::kAvg) want = want / world;
              const double tolerance = dtype == torch::kHalf ? 5e-2 : 1e-5;
              if (!torch::allclose(out_symmetric.to(torch::kDouble), want, tolerance, tolerance)) {
                failures[rank] += "numel " + std::to_string(numel) + " wrong sum; ";
              }
            }
          }
        }
      }
    });
    for (int rank = 0; rank < world; ++rank) EXPECT_EQ(failures[rank], "") << "world " << world;
  }
}

TEST(ShmSymmetric, ReduceScatterRanksThatDisagreeAboutTheInputFailClearly) {
  auto store = make_hash_store();
  std::vector<std::string> errors(2);
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2, Milliseconds(10'000));
    const int64_t numel = 1 << 16;  // 256 KiB in all: above the staged-only size
    auto symmetric = pg->empty_symmetric(2 * numel, torch::kFloat).fill_(1);
    auto ordinary = torch::ones({2 * numel});
    auto out = torch::empty({numel});
    try {
      pg->reduce_scatter_tensor(out, rank == 0 ? symmetric : ordinary)->wait();
    } catch (const Error& e) {
      errors[rank] = e.what();
    }
  });
  EXPECT_NE(errors[0].find("rank 1 passed an ordinary tensor"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0 passed a tensor from empty_symmetric()"), std::string::npos)
      << errors[1];
}

TEST(ShmSymmetric, OtherBackendsGiveOrdinaryTensorsAndNothingLeaks) {
  auto store = make_hash_store();
  run_threads(2, [&](int rank) {
    auto gloo = new_process_group("gloo", store, rank, 2);
    auto t = gloo->empty_symmetric(100, torch::kFloat).fill_(rank + 1);
    EXPECT_FALSE(gloo->is_symmetric(t));
    gloo->allreduce(t)->wait();
    EXPECT_TRUE(torch::equal(t, torch::full({100}, 3.0f)));
  });
  const std::string mine = "shoal-" + std::to_string(getpid()) + "-";
  run_threads(2, [&](int rank) {
    auto pg = new_process_group("shm", store, rank, 2);
    auto t = pg->empty_symmetric(1 << 20, torch::kFloat);
    EXPECT_EQ(pg->empty_symmetric(0, torch::kFloat).numel(), 0);
    EXPECT_THROW(pg->empty_symmetric(-1, torch::kFloat), InvalidArgument);
    for (const auto& entry : shm_entries()) {
      EXPECT_NE(entry.rfind(mine, 0), 0u) << "/dev/shm/" << entry << " outlived its allocation";
    }
  });
}

TEST(ShmAuto, NewProcessGroupAutoIsShm) {
  auto store = make_hash_store();
  auto pg = new_process_group("auto", store, 0, 1);
  EXPECT_EQ(pg->backend_name(), "shm");
}

TEST(Hierarchical, TwoPretendHostsOfTwoRanks) {
  auto results = run_processes(4, [](int rank, const std::string& path) {
    setenv("SHOAL_HOSTNAME", rank < 2 ? "host-a" : "host-b", 1);
    auto store = make_file_store(path, 4, Milliseconds(20'000));
    auto pg = new_process_group("hierarchical", store, rank, 4, Milliseconds(20'000));
    auto* hier = dynamic_cast<ProcessGroupHierarchical*>(pg.get());
    SHOAL_CHECK(hier != nullptr && hier->num_hosts() == 2, "expected 2 hosts");
    for (int64_t numel : {int64_t{1}, int64_t{1001}, int64_t{300'000}}) {
      auto t = input(rank, numel);
      pg->allreduce(t)->wait();
      SHOAL_CHECK(torch::equal(t, expected_sum(4, numel)), "allreduce sum of ", numel);
      auto a = torch::full({numel}, 2.0 * (rank + 1), torch::kDouble);
      pg->allreduce(a, {ReduceOp::kAvg})->wait();
      SHOAL_CHECK(torch::allclose(a, torch::full({numel}, 5.0, torch::kDouble)), "avg");
      auto m = input(rank, numel, torch::kInt);
      pg->allreduce(m, {ReduceOp::kMin})->wait();
      SHOAL_CHECK(torch::equal(m, input(0, numel, torch::kInt)), "min");
    }
    auto b = input(rank, 77);
    pg->broadcast(b, {3})->wait();
    SHOAL_CHECK(torch::equal(b, input(3, 77)), "broadcast");
  });
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << messages(results);
}

}  // namespace test_shm
}  // namespace shoal::comm
