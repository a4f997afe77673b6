// Every collective of the mpi backend under mpirun (world sizes 1-4, see CMakeLists.txt), with the
// same checks as the thread and forked-process tests (collective_checks.h). Every rank runs every
// test; only rank 0 prints. Exits 77 (skipped) when MPI is not built in or mpirun is absent.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <csignal>
#include <cstring>
#include <thread>

#include <unistd.h>

#include "collective_checks.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace {

using shoal::comm::testing::all_checks;
using shoal::comm::testing::element_counts;

// The world group, created once per process: MPI can be initialized only once.
std::shared_ptr<ProcessGroup> g_world;

class MpiCollectives : public ::testing::TestWithParam<size_t> {};

TEST_P(MpiCollectives, EveryElementCount) {
  for (int64_t numel : element_counts()) {
    SCOPED_TRACE("numel " + std::to_string(numel));
    all_checks()[GetParam()].fn(*g_world, numel);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Checks, MpiCollectives, ::testing::Range<size_t>(0, all_checks().size()),
    [](const ::testing::TestParamInfo<size_t>& info) { return all_checks()[info.param].name; });

TEST(MpiBackend, IsSelectedAndAgreesWithMpirun) {
  EXPECT_EQ(g_world->backend_name(), "mpi");
  if (const char* size = std::getenv("OMPI_COMM_WORLD_SIZE")) {
    EXPECT_EQ(g_world->size(), std::atoi(size));
    EXPECT_EQ(g_world->rank(), std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")));
  }
}

// Small collectives run on the caller's thread only when nothing is queued or running: issued
// behind a large one (queued for the worker), they still run after it, in order, on every rank.
TEST(MpiBackend, SmallCollectivesKeepTheirPlaceBehindLargeOnes) {
  const int n = g_world->size();
  for (int round = 0; round < 10; ++round) {
    auto large = torch::full({1 << 20}, static_cast<float>(g_world->rank() + 1));
    std::vector<torch::Tensor> small;
    std::vector<std::shared_ptr<Work>> works{g_world->allreduce(large)};
    for (int i = 0; i < 4; ++i) {
      small.push_back(torch::full({16}, static_cast<float>(g_world->rank() * 10 + i)));
      works.push_back(g_world->allreduce(small.back()));
    }
    for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
    EXPECT_TRUE(large.eq(n * (n + 1) / 2.0f).all().item<bool>()) << "round " << round;
    for (int i = 0; i < 4; ++i) {
      const float expected = 10.0f * n * (n - 1) / 2 + static_cast<float>(n) * i;
      EXPECT_TRUE(small[i].eq(expected).all().item<bool>())
          << "round " << round << " small " << i << ": " << small[i][0].item<float>();
    }
  }
}

TEST(MpiBackend, CollectiveMismatchIsReported) {
  auto group = g_world->new_group([&] {
    std::vector<int> all;
    for (int r = 0; r < g_world->size(); ++r) all.push_back(r);
    return all;
  }());
  group->set_check_collectives(true);  // as SHOAL_DEBUG=detail would
  auto t = torch::ones({g_world->rank() == 1 ? 2048 : 1024});
  try {
    if (group->rank() == 1) {
      group->broadcast(t, {0})->wait();
    } else {
      group->allreduce(t)->wait();
    }
    FAIL() << "expected a mismatch error";
  } catch (const shoal::PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("every rank must issue the same collectives"),
              std::string::npos)
        << e.what();
  }
  // The group is aborted; later operations fail at once.
  EXPECT_THROW(group->barrier()->wait(), shoal::PeerError);
}

// --fault=kill: rank 2 kills itself in an allreduce loop (OpenMPI then ends the job).
// --fault=delay: rank 2 comes after the time-out; ranks 0 and 1 print FAULT-OK when their error
// is a TimeoutError naming rank 2 within the time-out, the diagnosis budget and a margin. Run by
// test_faults.
int run_fault(const std::string& mode) {
  constexpr Milliseconds kTimeout{3000};
  InitOptions options;
  options.backend = "mpi";
  options.timeout = kTimeout;
  auto pg = init_process_group(options);
  auto t = torch::ones({1024});
  pg->allreduce(t)->wait();
  const auto start = std::chrono::steady_clock::now();
  try {
    if (mode == "--fault=kill") {
      for (int i = 0; i < 1'000'000; ++i) {
        if (pg->rank() == 2 && i == 10) raise(SIGKILL);
        pg->allreduce(t)->wait();
      }
    } else {
      // Rank 2 comes late by a handshake, not a sleep: once ranks 0 and 1 got their error. The
      // signal files are named after rank 0's pid, which every rank learns by a broadcast.
      auto pid = torch::full({1}, static_cast<int64_t>(getpid()), torch::kLong);
      pg->broadcast(pid, {0})->wait();
      const auto gave_up = [&](int r) {
        const char* dir = std::getenv("TMPDIR");
        return std::string(dir != nullptr && *dir ? dir : "/tmp") + "/shoal-test-mpi-fault-" +
               std::to_string(pid.item<int64_t>()) + ".gave-up." + std::to_string(r);
      };
      if (pg->rank() == 2) {
        for (int r : {0, 1}) {
          if (!shoal::testing::wait_for_file(gave_up(r), Milliseconds(30'000))) {
            std::printf("rank 2: rank %d never gave up\n", r);
            return 1;
          }
        }
        for (int r : {0, 1}) std::remove(gave_up(r).c_str());
        try {
          pg->allreduce(t, {ReduceOp::kSum, Milliseconds(500)})->wait();
        } catch (const shoal::Error&) {
          // Expected: the others gave up on it.
        }
        return 0;
      }
      try {
        pg->allreduce(t)->wait();
      } catch (...) {
        shoal::testing::touch_file(gave_up(pg->rank()));
        throw;
      }
      shoal::testing::touch_file(gave_up(pg->rank()));
    }
  } catch (const shoal::Error& e) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string what = e.what();
    const bool ok = dynamic_cast<const TimeoutError*>(&e) != nullptr &&
                    what.find("waiting for rank 2") != std::string::npos &&
                    elapsed <= shoal::testing::fault_deadline_seconds(kTimeout);
    std::printf("FAULT%s rank %d after %.2f s: %s\n", ok ? "-OK" : "", pg->rank(), elapsed,
                what.c_str());
    std::fflush(stdout);
    return ok ? 0 : 1;
  }
  return 0;
}

}  // namespace
}  // namespace shoal::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--fault=", 8) == 0) {
      if (!SHOAL_HAVE_MPI) shoal::testing::skip_program(shoal::testing::Dependency::kMpi, "the mpi backend is not built in");
      torch::set_num_threads(1);
      return shoal::comm::run_fault(argv[i]);
    }
    if (std::strcmp(argv[i], "--no-mpirun") == 0) {
      shoal::testing::skip_program(shoal::testing::Dependency::kMpi, "mpirun was not found when the tests were configured");
    }
  }
  if (!SHOAL_HAVE_MPI) shoal::testing::skip_program(shoal::testing::Dependency::kMpi, "the mpi backend is not built in");
  torch::set_num_threads(1);
  shoal::comm::InitOptions options;
  // Under mpirun "auto" must pick mpi by itself; a lone process asks for it.
  options.backend = std::getenv("OMPI_COMM_WORLD_RANK") != nullptr ? "auto" : "mpi";
  options.timeout = shoal::comm::Milliseconds(30'000);
  shoal::comm::g_world = shoal::comm::init_process_group(options);
  if (shoal::comm::g_world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  if (shoal::comm::g_world->size() < 2) {
    // A mismatch needs two ranks: at world size 1 the test is not run at all (rather than skipped
    // on every run); the _np2.._np4 runs cover it.
    std::string filter = GTEST_FLAG_GET(filter);
    filter += filter.find('-') == std::string::npos ? "-" : ":";
    GTEST_FLAG_SET(filter, filter + "MpiBackend.CollectiveMismatchIsReported");
  }
  const int rc = RUN_ALL_TESTS();
  shoal::comm::g_world.reset();
  return shoal::testing::test_program_exit_code(rc);
}
