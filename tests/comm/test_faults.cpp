// Fault injection across forked processes: a rank killed mid-loop, a rank that comes too late,
// ranks that issue different collectives, and rendezvous mistakes. Every other rank must fail
// fast with an error that names the rank at fault, and no process may be left behind. The mpi
// variants start test_collectives_mpi under mpirun in its fault modes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "shoal/comm/flight_recorder.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"
#include "testing/scoped_env.h"

namespace shoal::comm {
namespace test_faults {

using Clock = std::chrono::steady_clock;
using shoal::testing::ProcessResult;

// Short, so that the whole file runs in seconds; long enough for a loaded 2-core machine.
constexpr Milliseconds kTimeout{3000};
// For the collectives before a fault is injected: a loaded machine may start one rank seconds
// after the others, and no time-out may end a test before its fault.
constexpr AllreduceOptions kBeforeTheFault{ReduceOp::kSum, Milliseconds(30'000)};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void expect_all_reaped() {
  errno = 0;
  EXPECT_EQ(waitpid(-1, nullptr, WNOHANG), -1) << "a child process was left behind";
  EXPECT_EQ(errno, ECHILD);
}

std::string describe(const ProcessResult& r) {
  std::ostringstream out;
  out << "rank " << r.rank << ": exit " << r.exit_code << ", signal " << r.signal << ", "
      << r.seconds << " s, error: " << r.error;
  return out.str();
}

std::shared_ptr<ProcessGroup> gloo_group(int rank, int size, const std::string& store_path) {
  torch::set_num_threads(1);
  auto store = make_file_store(store_path, size, Milliseconds(30'000));
  return new_process_group("gloo", store, rank, size, kTimeout);
}

// Survivors throw unless they failed with an error naming `victim` within the time-out plus the
// diagnosis budget plus the load margin.
void expect_named_failure(ProcessGroup& pg, const std::function<void()>& op,
                          const std::string& victim) {
  const auto start = Clock::now();
  try {
    op();
  } catch (const shoal::Error& e) {
    const double elapsed = seconds_since(start);
    const std::string what = e.what();
    if (what.find(victim) == std::string::npos) {
      throw std::runtime_error("the error does not name " + victim + ": " + what);
    }
    if (elapsed > shoal::testing::fault_deadline_seconds(kTimeout)) {
      throw std::runtime_error("the error came after " + std::to_string(elapsed) + " s: " + what);
    }
    std::printf("rank %d got, after %.2f s: %s\n", pg.rank(), elapsed, what.c_str());
    return;
  }
  throw std::runtime_error("no error although " + victim + " is gone");
}

TEST(GlooFaults, KilledRankIsNamedByTheOthers) {
  constexpr int kWorld = 3;
  auto results = shoal::testing::run_processes(
      kWorld,
      [](int rank, const std::string& path) {
        auto pg = gloo_group(rank, kWorld, path);
        auto t = torch::ones({1024});
        for (int i = 0; i < 10; ++i) pg->allreduce(t, kBeforeTheFault)->wait();
        if (rank == 2) raise(SIGKILL);
        expect_named_failure(*pg, [&] {
          for (int i = 0; i < 1'000'000; ++i) pg->allreduce(t)->wait();
        }, "rank 2");
      },
      Milliseconds(30'000));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_EQ(results[2].signal, SIGKILL) << describe(results[2]);
  EXPECT_TRUE(results[0].ok()) << describe(results[0]);
  EXPECT_TRUE(results[1].ok()) << describe(results[1]);
  expect_all_reaped();
}

struct sigaction sigpipe_action() {
  struct sigaction current {};
  sigaction(SIGPIPE, nullptr, &current);
  return current;
}

void programs_own_sigpipe_handler(int) {}

// Gloo writes with writev, which raises SIGPIPE on a socket whose peer has gone: a rank writing
// to a peer that just left could die of the signal, silently, instead of failing its operation
// with an error that names the peer. Opening a gloo group sets SIGPIPE to "ignore" when the
// program left it at its default (as Python does for every PyTorch program), and keeps a handler
// the program installed. Then rank 0 goes on writing while rank 1 leaves.
TEST(GlooFaults, APeerThatLeftIsAnErrorNotASigpipe) {
  constexpr int kWorld = 2;
  auto results = shoal::testing::run_processes(
      kWorld,
      [](int rank, const std::string& path) {
        if (sigpipe_action().sa_handler != SIG_DFL) {
          throw std::runtime_error("SIGPIPE is not at its default before the group opens");
        }
        if (rank == 1) ::signal(SIGPIPE, programs_own_sigpipe_handler);
        auto pg = gloo_group(rank, kWorld, path);
        const auto after = sigpipe_action().sa_handler;
        if (rank == 0 && after != SIG_IGN) {
          throw std::runtime_error("the gloo group left SIGPIPE at its default (terminate)");
        }
        if (rank == 1 && after != programs_own_sigpipe_handler) {
          throw std::runtime_error("the gloo group replaced the program's own SIGPIPE handler");
        }
        auto t = torch::ones({1024});
        pg->allreduce(t, kBeforeTheFault)->wait();
        if (rank == 1) {
          // Takes some of rank 0's messages, then ends, closing its sockets while rank 0 is
          // still writing to them.
          for (int i = 0; i < 50; ++i) pg->recv(t, 0)->wait();
          return;
        }
        expect_named_failure(*pg, [&] {
          for (int i = 0; i < 1'000'000; ++i) pg->send(t, 1)->wait();
        }, "rank 1");
      },
      Milliseconds(60'000));
  EXPECT_NE(results[0].signal, SIGPIPE) << describe(results[0]);
  EXPECT_TRUE(results[0].ok()) << describe(results[0]);
  EXPECT_TRUE(results[1].ok()) << describe(results[1]);
  expect_all_reaped();
}

TEST(GlooFaults, LateRankIsNamedInTheTimeout) {
  constexpr int kWorld = 3;
  auto results = shoal::testing::run_processes(
      kWorld,
      [](int rank, const std::string& path) {
        auto pg = gloo_group(rank, kWorld, path);
        auto t = torch::ones({1024});
        pg->allreduce(t, kBeforeTheFault)->wait();
        // Rank 2 comes late by a handshake, not a sleep: only once both others got their error.
        const auto gave_up = [&](int r) { return path + ".gave-up." + std::to_string(r); };
        if (rank == 2) {
          for (int r : {0, 1}) {
            if (!shoal::testing::wait_for_file(gave_up(r), Milliseconds(30'000))) {
              throw std::runtime_error("rank " + std::to_string(r) + " never gave up on rank 2");
            }
          }
          try {
            pg->allreduce(t, {ReduceOp::kSum, Milliseconds(500)})->wait();
          } catch (const shoal::Error&) {
            // Expected: the others gave up on it.
          }
          return;
        }
        struct SignalOnExit {  // also when the expectation throws: rank 2 must not wait in vain
          std::string path;
          ~SignalOnExit() { shoal::testing::touch_file(path); }
        } signal{gave_up(rank)};
        expect_named_failure(*pg, [&] {
          try {
            pg->allreduce(t)->wait();
          } catch (const shoal::TimeoutError&) {
            throw;
          } catch (const std::exception& e) {
            throw std::runtime_error(std::string("not a TimeoutError: ") + e.what());
          }
        }, "rank 2");
      },
      Milliseconds(30'000));
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << describe(r);
  expect_all_reaped();
}

// Ranks issue different collectives at the same point: every rank gets a clear PeerError.
struct Mismatch {
  const char* name;
  std::function<std::shared_ptr<Work>(ProcessGroup&)> op;  // what each rank issues
  const char* rank0_message;                                // what rank 0 must be told
};

TEST(Mismatch, DifferentCollectivesAreReportedOnEveryRank) {
  const std::vector<Mismatch> cases = {
      {"op",
       [](ProcessGroup& pg) {
         auto t = torch::ones({pg.rank() == 0 ? 1000 : 2000});
         return pg.rank() == 0 ? pg.allreduce(t) : pg.broadcast(t, {0});
       },
       "[rank 0/2] allreduce #1 (4.0 kB float32, sum) does not match rank 1's broadcast #1 "
       "(8.0 kB float32, root 0): every rank must issue the same collectives in the same order"},
      {"numel",
       [](ProcessGroup& pg) {
         auto t = torch::ones({pg.rank() == 0 ? 10 : 11});
         return pg.allreduce(t);
       },
       "does not match rank 1's allreduce #1 (44 B float32, sum)"},
      {"dtype",
       [](ProcessGroup& pg) {
         auto t = torch::ones({10}, pg.rank() == 0 ? torch::kFloat : torch::kDouble);
         return pg.allreduce(t);
       },
       "does not match rank 1's allreduce #1 (80 B float64, sum)"},
      {"reduce op",
       [](ProcessGroup& pg) {
         auto t = torch::ones({10});
         return pg.allreduce(t, {pg.rank() == 0 ? ReduceOp::kSum : ReduceOp::kMax});
       },
       "(40 B float32, max)"},
      {"empty on one rank",
       [](ProcessGroup& pg) {
         auto t = torch::ones({pg.rank() == 0 ? 0 : 5});
         return pg.allreduce(t);
       },
       "does not match rank 1's allreduce #1 (20 B float32, sum)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    auto store = make_hash_store(Milliseconds(10'000));
    std::vector<std::string> errors(2);
    shoal::testing::run_threads(2, [&](int rank) {
      auto pg = new_process_group("gloo", store, rank, 2, kTimeout);
      pg->set_check_collectives(true);
      try {
        c.op(*pg)->wait();
      } catch (const shoal::PeerError& e) {
        errors[rank] = e.what();
      }
    });
    EXPECT_NE(errors[0].find(c.rank0_message), std::string::npos) << errors[0];
    EXPECT_NE(errors[1].find("[rank 1/2]"), std::string::npos) << errors[1];
    EXPECT_NE(errors[1].find("does not match rank 0's"), std::string::npos) << errors[1];
  }
}

// Off by default, as PyTorch's (its check runs under TORCH_DISTRIBUTED_DEBUG=DETAIL only): on
// under SHOAL_DEBUG=detail; SHOAL_CHECK_COLLECTIVES decides alone when set.
TEST(Mismatch, ChecksAreOnUnderDebugDetailOnly) {
  struct Case {
    const char* debug;
    const char* check;
    bool expected;
  };
  for (const Case& c : {Case{nullptr, nullptr, false}, Case{"detail", nullptr, true},
                        Case{"DETAIL", "0", false}, Case{nullptr, "1", true},
                        Case{"info", nullptr, false}}) {
    SCOPED_TRACE(std::string(c.debug ? c.debug : "-") + "/" + (c.check ? c.check : "-"));
    shoal::testing::ScopedEnv debug("SHOAL_DEBUG", c.debug);
    shoal::testing::ScopedEnv check("SHOAL_CHECK_COLLECTIVES", c.check);
    auto store = make_hash_store(Milliseconds(10'000));
    shoal::testing::run_threads(2, [&](int rank) {
      for (const char* backend : {"gloo", "cpu:shm,cuda:gloo"}) {
        auto pg = new_process_group(backend, store, rank, 2, kTimeout);
        EXPECT_EQ(pg->check_collectives(), c.expected) << backend;
        auto t = torch::ones({16});
        pg->allreduce(t)->wait();
        EXPECT_TRUE(torch::all(t == 2).item<bool>());
      }
    });
  }
}

// Rendezvous mistakes: clear InvalidArgument on every process, never a hang.
std::vector<ProcessResult> rendezvous(const std::vector<std::pair<int, int>>& rank_and_size) {
  const std::string path = shoal::testing::temp_path("rendezvous");
  std::vector<std::unique_ptr<shoal::testing::ChildProcess>> children;
  for (const auto& [rank, size] : rank_and_size) {
    children.push_back(std::make_unique<shoal::testing::ChildProcess>([=] {
      InitOptions options;
      options.backend = "gloo";
      options.init_method = "file://" + path;
      options.rank = rank;
      options.world_size = size;
      options.timeout = kTimeout;
      init_process_group(options);
    }));
  }
  std::vector<ProcessResult> results;
  for (size_t i = 0; i < children.size(); ++i) {
    EXPECT_TRUE(children[i]->wait(kTimeout * 2)) << "process " << i << " hangs";
    results.push_back(children[i]->result());
    results.back().rank = rank_and_size[i].first;
  }
  children.clear();  // kills and reaps any left
  std::remove(path.c_str());
  return results;
}

TEST(Rendezvous, TwoProcessesClaimingOneRank) {
  for (const auto& r : rendezvous({{0, 2}, {0, 2}})) {
    EXPECT_NE(r.error.find("two processes claim rank 0"), std::string::npos) << describe(r);
    EXPECT_LT(r.seconds, kTimeout.count() / 1000.0) << describe(r);
  }
  expect_all_reaped();
}

TEST(Rendezvous, WorldSizesThatDisagree) {
  for (const auto& r : rendezvous({{0, 2}, {1, 3}})) {
    EXPECT_NE(r.error.find("was started with world size"), std::string::npos) << describe(r);
    EXPECT_LT(r.seconds, kTimeout.count() / 1000.0) << describe(r);
  }
  expect_all_reaped();
}

TEST(Rendezvous, RankOutOfRange) {
  InitOptions options;
  options.backend = "gloo";
  options.init_method = "file://" + shoal::testing::temp_path("unused");
  options.rank = 2;
  options.world_size = 2;
  try {
    init_process_group(options);
    FAIL() << "rank 2 of 2 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 is not below the world size 2"),
              std::string::npos)
        << e.what();
  }
}

TEST(Rendezvous, MissingRankTimesOutNamingIt) {
  const auto results = rendezvous({{0, 3}, {1, 3}});
  for (const auto& r : results) {
    EXPECT_NE(r.error.find("rank 2 did not join"), std::string::npos) << describe(r);
  }
  expect_all_reaped();
}

TEST(Rendezvous, TheDeadlineHoldsWhateverTheWorldSize) {
  // A lone rank 0 of 2^20 (the largest world accepted): a pass over the others is a million store
  // round trips, seconds to minutes; the time-out holds all the same, and names a few.
  const auto results = rendezvous({{0, 1 << 20}});
  for (const auto& r : results) {
    EXPECT_NE(r.error.find("did not join within"), std::string::npos) << describe(r);
    EXPECT_NE(r.error.find("ranks 1, 2, 3"), std::string::npos) << describe(r);
    EXPECT_NE(r.error.find(" of 1048576)"), std::string::npos) << describe(r);
    EXPECT_LT(r.error.size(), 1000u) << describe(r);
    EXPECT_LT(r.seconds, kTimeout.count() / 1000.0 + 2) << describe(r);
  }
  expect_all_reaped();
}

// --- mpi: test_collectives_mpi --fault=... under mpirun ------------------------------------------

// Runs mpirun -np `np` test_collectives_mpi `mode`; returns its result and output.
ProcessResult run_mpi_fault(int np, const std::string& mode, std::string* output,
                            Milliseconds limit) {
  const char* bin = std::getenv("SHOAL_BINARY_DIR");
  const std::string program = std::string(bin ? bin : ".") + "/tests/comm/test_collectives_mpi";
  const std::string log = shoal::testing::temp_path("mpirun-log");
  shoal::testing::ChildProcess mpirun([&] {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    const std::string n = std::to_string(np);
    execlp("mpirun", "mpirun", "--oversubscribe", "--mca", "btl", "self,vader", "-np", n.c_str(),
           program.c_str(), mode.c_str(), static_cast<char*>(nullptr));
    std::_Exit(127);
  });
  if (!mpirun.wait(limit)) {
    ADD_FAILURE() << "mpirun " << mode << " still runs after " << limit.count() << " ms";
    mpirun.kill(SIGKILL);
    mpirun.wait(Milliseconds(10'000));
  }
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  *output = text.str();
  std::remove(log.c_str());
  return mpirun.result();
}

// A macro, not a function: GTEST_SKIP in a helper would return from the helper only and let the
// test run on.
#define SHOAL_REQUIRE_MPI()                                                                    \
  do {                                                                                         \
    SHOAL_SKIP_UNLESS(is_backend_available("mpi"), shoal::testing::Dependency::kMpi,           \
                      "the mpi backend is not built in");                                      \
    SHOAL_SKIP_UNLESS(std::system("command -v mpirun >/dev/null 2>&1") == 0,                   \
                      shoal::testing::Dependency::kMpi, "no mpirun");                          \
  } while (0)

// OpenMPI's runtime aborts the whole job when a rank dies: what is tested is that mpirun ends,
// soon and with a failure status, rather than hanging.
TEST(MpiFaults, KilledRankEndsTheJob) {
  SHOAL_REQUIRE_MPI();
  std::string output;
  const auto start = Clock::now();
  const auto result = run_mpi_fault(3, "--fault=kill", &output, Milliseconds(30'000));
  const double elapsed = seconds_since(start);
  EXPECT_FALSE(result.ok()) << output;
  EXPECT_LT(elapsed, 20.0) << output;
  std::printf("mpirun ended after %.1f s with exit %d signal %d\n", elapsed, result.exit_code,
              result.signal);
  expect_all_reaped();
}

TEST(MpiFaults, LateRankIsNamedInTheTimeout) {
  SHOAL_REQUIRE_MPI();
  std::string output;
  run_mpi_fault(3, "--fault=delay", &output, Milliseconds(40'000));
  EXPECT_NE(output.find("FAULT-OK rank 0"), std::string::npos) << output;
  EXPECT_NE(output.find("FAULT-OK rank 1"), std::string::npos) << output;
  expect_all_reaped();
}


// A hung job says what it was doing: rank 0 is inside allreduce #2 that rank 1 has not joined;
// SIGUSR1 (kill -USR1) makes the process print every group's recent operations to stderr, with
// the hung one "in flight" and the finished one not; then rank 1 joins and both finish.
TEST(FlightRecorder, SigusrOnePrintsTheOperationInFlight) {
  install_dump_on_sigusr1();
  auto store = make_hash_store(Milliseconds(60'000));
  // Rank 1 has finished allreduce #1 (its Work released): set by rank 1's own thread, which a
  // loaded machine may schedule long after rank 0 has returned from the same allreduce.
  std::atomic<bool> first_done{false};
  std::atomic<bool> dumped{false};
  std::string not_ready;  // why the dump was not taken, if it was not
  const std::string log = shoal::testing::temp_path("sigusr1-dump");
  std::string text;
  shoal::testing::run_threads(2, [&](int rank) {
    torch::set_num_threads(1);
    auto pg = new_process_group("gloo", store, rank, 2, Milliseconds(60'000));
    at::Tensor t = torch::ones({1000});
    pg->allreduce(t)->wait();
    if (rank == 0) {
      // The collective check makes allreduce itself block until rank 1 comes: the signal is sent
      // from another thread once the operation shows as in flight here and rank 1 is done with
      // allreduce #1 (conditions waited for, each with a deadline, never a sleep).
      std::thread observer([&] {
        auto in_flight = [&] {
          for (const std::string& op : pg->recent_operations()) {
            if (op.find("allreduce #2") != std::string::npos &&
                op.find("in flight") != std::string::npos) {
              return true;
            }
          }
          return false;
        };
        if (!shoal::testing::wait_until([&] { return in_flight() && first_done.load(); },
                                        Milliseconds(30'000))) {
          not_ready = std::string("after 30 s: allreduce #2 ") +
                      (in_flight() ? "in flight" : "not in flight") + " on rank 0, rank 1 " +
                      (first_done ? "done" : "not done") + " with allreduce #1";
          dumped = true;
          return;
        }
        // stderr into a file while the dump thread answers the signal; the dump is one write of
        // every group's lines, rank 1's among them.
        std::fflush(stderr);
        const int saved = ::dup(2);
        const int file = ::open(log.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
        ::dup2(file, 2);
        ::kill(::getpid(), SIGUSR1);
        shoal::testing::wait_until([&] {
          text = shoal::testing::read_file(log);
          return text.find("[rank 0/2]") != std::string::npos &&
                 text.find("[rank 1/2]") != std::string::npos;
        }, Milliseconds(30'000));
        std::fflush(stderr);
        ::dup2(saved, 2);
        ::close(saved);
        ::close(file);
        dumped = true;
      });
      pg->allreduce(t)->wait();
      observer.join();
    } else {
      first_done = true;
      if (!shoal::testing::wait_until([&] { return dumped.load(); }, Milliseconds(60'000))) {
        throw std::runtime_error("rank 0 never took the dump");
      }
      pg->allreduce(t)->wait();
      // Both done now: the same group reports nothing in flight.
      for (const std::string& op : pg->recent_operations()) {
        EXPECT_EQ(op.find("in flight"), std::string::npos) << op;
      }
    }
  }, std::chrono::milliseconds(120'000));
  std::filesystem::remove(log);
  ASSERT_EQ(not_ready, "");
  EXPECT_NE(text.find("recent operations of"), std::string::npos) << text;
  EXPECT_NE(text.find("[rank 0/2] last 2 operation(s)"), std::string::npos) << text;
  EXPECT_NE(text.find("allreduce #2 (4.0 kB float32, sum): in flight for"), std::string::npos)
      << text;
  EXPECT_EQ(text.find("allreduce #1 (4.0 kB float32, sum): in flight"), std::string::npos) << text;
  EXPECT_NE(text.find("[rank 1/2] last 1 operation(s)"), std::string::npos) << text;
}


// Hang forensics: when a collective times out, the error names every rank's last started and
// last completed operation, gathered through the store. Rank 2 stops calling collectives after
// allreduce #2 (it waits for the others' files: busy elsewhere, alive); ranks 0 and 1 time out in
// allreduce #3 and their errors show rank 2 behind, in #2, with its DDP-style note.
class HangReport : public ::testing::TestWithParam<const char*> {};

constexpr Milliseconds kHangTimeout{2000};

std::shared_ptr<ProcessGroup> hang_group(const char* backend, int rank, int size,
                                         const std::string& store_path) {
  torch::set_num_threads(1);
  auto store = make_file_store(store_path, size, Milliseconds(30'000));
  return new_process_group(backend, store, rank, size, kHangTimeout);
}

// The report lines of `what` a rank must show, or a description of what is missing.
std::string missing_report_lines(const std::string& what, const std::vector<std::string>& lines) {
  std::string missing;
  for (const auto& line : lines) {
    if (what.find(line) == std::string::npos) missing += "\n  missing: " + line;
  }
  return missing.empty() ? "" : missing + "\nin: " + what;
}

TEST_P(HangReport, EveryRankNamesEveryRanksLastOperation) {
  const char* backend = GetParam();
  constexpr int kWorld = 3;
  auto results = shoal::testing::run_processes(
      kWorld,
      [backend](int rank, const std::string& path) {
        auto pg = hang_group(backend, rank, kWorld, path);
        auto t = torch::ones({16});
        pg->allreduce(t, kBeforeTheFault)->wait();
        AllreduceOptions bucket = kBeforeTheFault;
        bucket.note = "bucket 0: fc.weight, fc.bias";
        pg->allreduce(t, bucket)->wait();
        const auto gave_up = [&](int r) { return path + ".gave-up." + std::to_string(r); };
        if (rank == 2) {
          // Behind: alive, but not calling collectives until both others have their error.
          if (!shoal::testing::wait_for_files({gave_up(0), gave_up(1)}, Milliseconds(30'000))) {
            throw std::runtime_error("ranks 0 and 1 never gave up on rank 2");
          }
          return;
        }
        struct SignalOnExit {  // also when the expectation throws: rank 2 must not wait in vain
          std::string path;
          ~SignalOnExit() { shoal::testing::touch_file(path); }
        } signal{gave_up(rank)};
        const auto start = Clock::now();
        try {
          pg->allreduce(t)->wait();
        } catch (const shoal::Error& e) {
          // shm: the first rank to time out aborts the group, so the other fails at once naming
          // the abort; both carry the table.
          const std::string what = e.what();
          const std::string missing = missing_report_lines(
              what, {"every rank's last operations (gathered through the store",
                     "rank 0: started allreduce #3 (64 B float32, sum), in flight for",
                     "; completed allreduce #2 (64 B float32, sum) [bucket 0: fc.weight, fc.bias]",
                     "rank 1: started allreduce #3 (64 B float32, sum), in flight for",
                     "rank 2: started allreduce #2 (64 B float32, sum) [bucket 0: fc.weight, "
                     "fc.bias], completed  <- behind"});
          if (!missing.empty()) throw std::runtime_error(missing);
          const double elapsed = seconds_since(start);
          if (elapsed > shoal::testing::fault_deadline_seconds(kHangTimeout)) {
            throw std::runtime_error("the error came after " + std::to_string(elapsed) + " s");
          }
          std::printf("rank %d got, after %.2f s: %s\n", rank, elapsed, what.c_str());
          return;
        }
        throw std::runtime_error("allreduce #3 did not fail although rank 2 never joined it");
      },
      Milliseconds(30'000));
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << describe(r);
  expect_all_reaped();
}

INSTANTIATE_TEST_SUITE_P(Backends, HangReport, ::testing::Values("shm", "gloo"),
                         [](const auto& info) { return std::string(info.param); });

// The stopped-rank tests: rank 2 publishes its pid and stops itself (all its threads stand still);
// rank 0 kills it once it has its error; rank 0, which serves the store, stays until rank 1 has
// its error too.
void stop_self(const std::string& path) {
  std::ofstream(path + ".pid.tmp") << ::getpid();
  std::filesystem::rename(path + ".pid.tmp", path + ".pid");
  ::raise(SIGSTOP);
}

void kill_stopped(const std::string& path) {
  std::ifstream pid_file(path + ".pid");
  int pid = 0;
  if (pid_file >> pid && pid > 0) ::kill(pid, SIGKILL);
}

void keep_store_for_rank_one(int rank, const std::string& path) {
  if (rank == 1) shoal::testing::touch_file(path + ".reported.1");
  if (rank == 0 && !shoal::testing::wait_for_file(path + ".reported.1", Milliseconds(30'000))) {
    throw std::runtime_error("rank 1 never got its error");
  }
}

void expect_rank_two_stopped_and_killed(const std::vector<ProcessResult>& results) {
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].ok()) << describe(results[0]);
  EXPECT_TRUE(results[1].ok()) << describe(results[1]);
  EXPECT_EQ(results[2].signal, SIGKILL) << describe(results[2]);
  expect_all_reaped();
}

// A stopped rank (SIGSTOP: all its threads stand still) cannot answer: the report says so, and
// the others' errors still come within the time-out plus the report's budget. Over a TCP store
// served by rank 0 (as env:// does): a file store's lock, held by a rank stopped at that moment,
// would stall the others' store requests.
TEST(HangReportStopped, StoppedRankHasNoReport) {
  constexpr int kWorld = 3;
  const int port = shoal::testing::free_port();
  auto results = shoal::testing::run_processes(
      kWorld,
      [port](int rank, const std::string& path) {
        torch::set_num_threads(1);
        auto store = make_tcp_store("127.0.0.1", port, kWorld, rank == 0, Milliseconds(30'000));
        auto pg = new_process_group("gloo", store, rank, kWorld, kHangTimeout);
        auto t = torch::ones({16});
        pg->allreduce(t, kBeforeTheFault)->wait();
        if (rank == 2) {
          stop_self(path);
          return;
        }
        const auto start = Clock::now();
        try {
          pg->allreduce(t)->wait();
        } catch (const shoal::Error& e) {
          const std::string what = e.what();
          const double elapsed = seconds_since(start);
          if (rank == 0) kill_stopped(path);  // the stopped rank is not needed any more
          const std::string missing = missing_report_lines(
              what, {"rank 0: started allreduce #2", "rank 1: started allreduce #2",
                     "rank 2: no report (dead or stopped?)"});
          if (!missing.empty()) throw std::runtime_error(missing);
          if (elapsed > shoal::testing::fault_deadline_seconds(kHangTimeout) + 2.0) {
            throw std::runtime_error("the error came after " + std::to_string(elapsed) + " s");
          }
          std::printf("rank %d got, after %.2f s: %s\n", rank, elapsed, what.c_str());
          keep_store_for_rank_one(rank, path);
          return;
        }
        throw std::runtime_error("allreduce #2 did not fail although rank 2 is stopped");
      },
      Milliseconds(30'000));
  expect_rank_two_stopped_and_killed(results);
}

// The heartbeat separates stopped from slow on a backend that cannot read the peer's process
// state (Gloo, as between hosts): with a long group time-out (60 s) and SHOAL_HEARTBEAT_TIMEOUT
// of 2 s, a rank that sleeps 4 s before joining is waited for (its answering thread keeps
// beating), and a rank stopped by SIGSTOP is named, with its heartbeat, well before the time-out.
TEST(Heartbeat, GlooWaitsForASlowRankAndNamesAStoppedOneInSeconds) {
  constexpr int kWorld = 3;
  constexpr Milliseconds kLongTimeout{60'000};
  const int port = shoal::testing::free_port();
  auto results = shoal::testing::run_processes(
      kWorld,
      [port](int rank, const std::string& path) {
        ::setenv("SHOAL_HEARTBEAT_TIMEOUT", "2s", 1);
        torch::set_num_threads(1);
        auto store = make_tcp_store("127.0.0.1", port, kWorld, rank == 0, Milliseconds(60'000));
        auto pg = new_process_group("gloo", store, rank, kWorld, kLongTimeout);
        auto t = torch::ones({16});
        pg->allreduce(t)->wait();
        // Slow, not stopped: rank 1 comes 4 s late, twice the heartbeat limit. Late after the
        // others have started their clocks (a handshake): a loaded machine may schedule them long
        // after rank 1 left allreduce #1, and then they would wait less than 4 s.
        const auto marked = [&](const char* what, int r) {
          return path + "." + what + "." + std::to_string(r);
        };
        if (rank == 1 && !shoal::testing::wait_for_files({marked("slow-start", 0),
                                                          marked("slow-start", 2)},
                                                         Milliseconds(30'000))) {
          throw std::runtime_error("ranks 0 and 2 never reached allreduce #2");
        }
        const auto slow_start = Clock::now();
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(4000));  // the injected delay
        } else {
          shoal::testing::touch_file(marked("slow-start", rank));
        }
        pg->allreduce(t)->wait();
        const double slow = seconds_since(slow_start);
        if (slow < 3.5) throw std::runtime_error("allreduce #2 ended after " + std::to_string(slow) + " s");
        if (t[0].item<float>() != 9.0f) throw std::runtime_error("allreduce #2 gave a wrong sum");
        if (rank == 2) {
          // Stopped once the others' clocks run, so that its silence falls within what they time.
          if (!shoal::testing::wait_for_files({marked("started-3", 0), marked("started-3", 1)},
                                              Milliseconds(30'000))) {
            throw std::runtime_error("ranks 0 and 1 never reached allreduce #3");
          }
          stop_self(path);
          return;
        }
        const auto start = Clock::now();
        shoal::testing::touch_file(marked("started-3", rank));
        try {
          pg->allreduce(t)->wait();
        } catch (const shoal::PeerError& e) {
          const std::string what = e.what();
          const double elapsed = seconds_since(start);
          if (rank == 0) kill_stopped(path);
          for (const char* expected : {"allreduce #3", "waiting for rank 2 (", "heartbeat has stood still",
                                       "SHOAL_HEARTBEAT_TIMEOUT", "rank 2: no report"}) {
            if (what.find(expected) == std::string::npos) {
              throw std::runtime_error(std::string("the error lacks '") + expected + "': " + what);
            }
          }
          // 2 s of silence, up to a poll interval to see it, the 2 s report budget, load.
          if (elapsed < 1.5 || elapsed > 12.0) {
            throw std::runtime_error("the error came after " + std::to_string(elapsed) + " s: " + what);
          }
          std::printf("rank %d got, after %.2f s: %s\n", rank, elapsed, what.c_str());
          keep_store_for_rank_one(rank, path);
          return;
        }
        throw std::runtime_error("allreduce #3 did not fail although rank 2 is stopped");
      },
      Milliseconds(90'000));
  expect_rank_two_stopped_and_killed(results);
}

}  // namespace test_faults
}  // namespace shoal::comm
