// Every collective of every backend, on 1..4 ranks, element counts 0, 1, odd and large, checked
// against values computed independently (collective_checks.h): ranks as threads of one process
// over an in-memory store, and ranks as forked processes meeting through a file store. The same
// checks run under mpirun in test_collectives_mpi.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <thread>

#include "collective_checks.h"
#include "comm/algorithms/allreduce_algorithm.h"
#include "comm/gloo/process_group_gloo.h"
#include "comm/multi_device/process_group_multi_device.h"
#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace shoal::comm {
namespace test_collectives {

using shoal::comm::testing::all_checks;
using shoal::comm::testing::element_counts;

// The barrier check is not fooled by a barrier that returns at once: every rank sees that the
// early ones left before the late one entered.
TEST(BarrierCheck, FailsForABarrierThatDoesNotWait) {
  torch::set_num_threads(1);
  auto store = make_hash_store(Milliseconds(30'000));
  std::atomic<int> caught{0};
  shoal::testing::run_threads(2, [&](int rank) {
    auto pg = new_process_group("gloo", store, rank, 2, Milliseconds(30'000));
    try {
      shoal::comm::testing::check_barrier_with(*pg, 1, [] {});
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("left before rank 1 entered"), std::string::npos) << e.what();
      ++caught;
    }
  });
  EXPECT_EQ(caught.load(), 2);
}

struct Case {
  std::string backend;
  int world_size;
  size_t check;  // index into all_checks()
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string backend = info.param.backend;  // "cpu:shm" -> "cpu_shm": test names are identifiers
  for (char& c : backend) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return backend + "_w" + std::to_string(info.param.world_size) + "_" +
         all_checks()[info.param.check].name;
}

class Collectives : public ::testing::TestWithParam<Case> {};

// One thread per rank, each with its own group over one hash store; every element count in turn.
TEST_P(Collectives, OnThreads) {
  const Case c = GetParam();
  auto store = make_hash_store(Milliseconds(60'000));
  shoal::testing::run_threads(c.world_size, [&](int rank) {
    auto pg = new_process_group(c.backend, store, rank, c.world_size, Milliseconds(60'000));
    for (int64_t numel : element_counts()) all_checks()[c.check].fn(*pg, numel);
  });
}

std::vector<Case> cases() {
  std::vector<Case> out;
  // "cpu:shm": the multi-device group (PyTorch 2.x's "cpu:gloo,cuda:nccl") passing CPU tensors
  // through to its CPU backend, with the collective check done once, by the outer group.
  for (const std::string backend : {"gloo", "shm", "hierarchical", "cpu:shm"}) {
    for (int w = 1; w <= 4; ++w) {
      for (size_t check = 0; check < all_checks().size(); ++check) {
        out.push_back({backend, w, check});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Backends, Collectives, ::testing::ValuesIn(cases()), case_name);

// A backend per device type: CPU tensors go to the CPU backend only (its operation count moves,
// the CUDA backend's does not), the collective check still catches a mismatch (run by the outer
// group, once), sub-groups are multi-device too, and a bad spec is refused naming what is wrong.
TEST(MultiDevice, CpuTensorsGoToTheCpuBackendAndTheCheckStillHolds) {
  torch::set_num_threads(1);
  auto store = make_hash_store(Milliseconds(30'000));
  shoal::testing::run_threads(2, [&](int rank) {
    // gloo stands in for nccl as the CUDA backend: no GPU here, and only CPU tensors are used.
    auto pg = new_process_group("cpu:shm,cuda:gloo", store, rank, 2, Milliseconds(10'000));
    EXPECT_EQ(pg->backend_name(), "cpu:shm,cuda:gloo");
    auto* multi = dynamic_cast<ProcessGroupMultiDevice*>(pg.get());
    ASSERT_NE(multi, nullptr);
    ProcessGroup* cpu = multi->backend_for(c10::DeviceType::CPU);
    ProcessGroup* cuda = multi->backend_for(c10::DeviceType::CUDA);
    ASSERT_NE(cpu, nullptr);
    ASSERT_NE(cuda, nullptr);
    EXPECT_EQ(cpu->backend_name(), "shm");
    EXPECT_EQ(cuda->backend_name(), "gloo");
    EXPECT_EQ(multi->backend_for(c10::DeviceType::Meta), nullptr);
    // The outer group checks (when SHOAL_DEBUG=detail asks), never its backends a second time.
    EXPECT_EQ(pg->check_collectives(), shoal::comm::debug_detail_from_env());
    EXPECT_FALSE(cpu->check_collectives());
    EXPECT_FALSE(cuda->check_collectives());
    const uint64_t cuda_before = cuda->sequence_number();

    auto t = torch::full({5}, static_cast<float>(rank + 1));
    pg->allreduce(t)->wait();
    EXPECT_TRUE(torch::equal(t, torch::full({5}, 3.0f)));
    auto b = torch::full({3}, static_cast<double>(rank));
    pg->broadcast(b, {1})->wait();
    EXPECT_TRUE(torch::equal(b, torch::ones({3}, torch::kDouble)));
    pg->barrier()->wait();
    EXPECT_EQ(cuda->sequence_number(), cuda_before);
    EXPECT_GE(cpu->sequence_number(), 3u);

    // A mismatch (different element counts) is a clear error on both ranks, not a hang, when the
    // outer group checks (as SHOAL_DEBUG=detail would have it).
    pg->set_check_collectives(true);
    auto wrong = torch::zeros({rank == 0 ? 4 : 6});
    try {
      pg->allreduce(wrong)->wait();
      ADD_FAILURE() << "mismatched allreduce did not fail on rank " << rank;
    } catch (const shoal::Error& e) {
      EXPECT_NE(std::string(e.what()).find("allreduce"), std::string::npos) << e.what();
    }

    auto sub = pg->new_group({0, 1});
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->backend_name(), "cpu:shm,cuda:gloo");
    auto s = torch::full({2}, 1.0f);
    sub->allreduce(s)->wait();
    EXPECT_TRUE(torch::equal(s, torch::full({2}, 2.0f)));
  });
}

TEST(MultiDevice, BadSpecsAreRefusedNamingTheProblem) {
  auto store = make_hash_store(Milliseconds(5'000));
  auto expect_refused = [&](const std::string& spec, const std::string& words) {
    try {
      new_process_group(spec, store, 0, 1, Milliseconds(5'000));
      ADD_FAILURE() << spec << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << spec << ": " << e.what();
    }
  };
  expect_refused("cuda:gloo", "has no cpu part");
  expect_refused("cpu:shm,xpu:gloo", "device type 'xpu' is not known");
  expect_refused("cpu:shm,cpu:gloo", "twice");
  expect_refused("cpu:", "is not DEVICE:BACKEND");
  expect_refused("cpu:auto", "concrete backend");
  expect_refused("cpu:tcp", "unknown backend 'tcp'");
  EXPECT_TRUE(is_backend_available("cpu:shm,cuda:gloo"));
  EXPECT_FALSE(is_backend_available("cpu:shm,xpu:gloo"));
  EXPECT_EQ(is_backend_available("cpu:gloo,cuda:nccl"), is_backend_available("nccl"));
}

// Ranks as forked processes meeting through a file store: every check, every element count.
class CollectivesAcrossProcesses : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesAcrossProcesses, Gloo) {
  const int world_size = GetParam();
  auto results = shoal::testing::run_processes(
      world_size,
      [&](int rank, const std::string& store_path) {
        torch::set_num_threads(1);
        auto store = make_file_store(store_path, world_size, Milliseconds(30'000));
        auto pg = new_process_group("gloo", store, rank, world_size, Milliseconds(30'000));
        for (int64_t numel : element_counts()) {
          for (const auto& check : all_checks()) check.fn(*pg, numel);
        }
      },
      Milliseconds(100'000));
  for (const auto& r : results) {
    EXPECT_TRUE(r.ok()) << "rank " << r.rank << " exit " << r.exit_code << " signal " << r.signal
                        << ": " << r.error;
  }
}

// World size 4 costs the most on two cores; 2 and 3 cover even and odd.
INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesAcrossProcesses, ::testing::Values(2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

// Gloo's ring reduce_scatter (point-to-point sends) gives what the allreduce of every block it
// replaced gave: integer-valued inputs, so that the two summation orders agree exactly.
TEST(GlooReduceScatter, RingEqualsTheAllreduceOfEveryBlock) {
  torch::set_num_threads(1);
  auto run = [](const char* how, int world, int64_t block, ReduceOp op, bool list) {
    ::setenv("SHOAL_GLOO_REDUCE_SCATTER", how, 1);
    std::vector<at::Tensor> outputs(static_cast<size_t>(world));
    auto store = make_hash_store(Milliseconds(30'000));
    shoal::testing::run_threads(world, [&](int rank) {
      auto pg = new_process_group("gloo", store, rank, world, Milliseconds(30'000));
      at::Tensor input = at::arange(block * world, at::kFloat).remainder(7).add(rank + 1);
      at::Tensor output = at::full({block}, -1.0f);
      if (list) {
        std::vector<at::Tensor> blocks = input.chunk(world);
        for (auto& b : blocks) b = b.contiguous();
        pg->reduce_scatter(output, blocks, {op})->wait();
      } else {
        pg->reduce_scatter_tensor(output, input, {op})->wait();
      }
      outputs[static_cast<size_t>(rank)] = output;
    });
    ::unsetenv("SHOAL_GLOO_REDUCE_SCATTER");
    return outputs;
  };
  for (int world : {2, 3, 4}) {
    for (int64_t block : {int64_t{1}, int64_t{7}, int64_t{1000}}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
        const bool list = block == 7;
        const auto old_way = run("allreduce", world, block, op, list);
        const auto ring = run("ring", world, block, op, list);
        for (int r = 0; r < world; ++r) {
          EXPECT_TRUE(ring[r].equal(old_way[r]))
              << "world " << world << ", block " << block << ", " << to_string(op) << ", rank " << r;
        }
      }
    }
  }
}

// ---- allreduce schedules of the gloo backend --------------------------------------------------

using algorithms::AllreduceAlgorithm;

const std::vector<AllreduceAlgorithm> kSchedules{
    AllreduceAlgorithm::kRing, AllreduceAlgorithm::kTree, AllreduceAlgorithm::kRecursiveDoubling,
    AllreduceAlgorithm::kRabenseifner, AllreduceAlgorithm::kAuto};

// Rank `rank`'s input of `numel` elements: random floats in [-1, 1), or (`integral`) integers in
// [-100, 100] (or [0, 3] for unsigned bytes and for products, which must not overflow).
at::Tensor schedule_input(int rank, int64_t numel, at::ScalarType dtype, ReduceOp op) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + rank));
  const bool small = op == ReduceOp::kProduct || dtype == at::kByte;
  if (dtype == at::kFloat && op == ReduceOp::kSum) {
    return at::rand({numel}, gen, at::kDouble).mul(2).sub(1).to(at::kFloat);
  }
  return at::randint(small ? 0 : -100, small ? 4 : 101, {numel}, gen, at::kLong).to(dtype);
}

// What every rank must get, reduced here from every rank's input (in float64 for floats).
at::Tensor locally_reduced(int world, int64_t numel, at::ScalarType dtype, ReduceOp op) {
  const bool floating = at::isFloatingType(dtype);
  at::Tensor acc = schedule_input(0, numel, dtype, op).to(floating ? at::kDouble : at::kLong);
  for (int r = 1; r < world; ++r) {
    algorithms::combine_into(acc, schedule_input(r, numel, dtype, op).to(acc.scalar_type()), op);
  }
  if (op == ReduceOp::kAvg) acc = floating ? acc / world : acc.floor_divide(world);
  return acc.to(dtype);
}

// Floats summed in another order: each result is within (n-1) * eps * sum|x_r| of the exact sum
// (the standard bound for recursive summation), so two orders are within twice that.
void expect_close_sums(const at::Tensor& got, const at::Tensor& want, int world, const std::string& what) {
  at::Tensor abs_sum = at::zeros_like(want, at::kDouble);
  for (int r = 0; r < world; ++r) abs_sum += schedule_input(r, want.numel(), at::kFloat, ReduceOp::kSum).abs();
  const double eps = std::numeric_limits<float>::epsilon();
  at::Tensor bound = abs_sum * (2.0 * (world - 1) * eps) + 1e-30;
  EXPECT_TRUE((got.to(at::kDouble) - want.to(at::kDouble)).abs().le(bound).all().item<bool>()) << what;
}

// One rank's group with every schedule in turn on the same inputs. Integer-valued inputs (every
// dtype and op but float32 sum) reduce exactly in any order: those results equal the ring's and
// the local reduction bit for bit; random float32 sums agree within the bound above.
void check_schedules_on_rank(ProcessGroupGloo& pg, int world, std::vector<std::string>& failures) {
  struct Kind {
    at::ScalarType dtype;
    ReduceOp op;
  };
  std::vector<Kind> kinds{{at::kFloat, ReduceOp::kSum}, {at::kLong, ReduceOp::kSum}};
  for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
    kinds.push_back({at::kFloat, op});
    kinds.push_back({at::kLong, op});
  }
  for (at::ScalarType dtype : {at::kDouble, at::kBFloat16, at::kInt, at::kByte}) kinds.push_back({dtype, ReduceOp::kSum});
  const std::vector<int64_t> sizes{1, 1024, 65536, 262144 + 3};  // floats: 4 B, 4 KiB, 256 KiB, 1 MiB + 3
  for (const Kind& kind : kinds) {
    for (int64_t numel : sizes) {
      // Every op and dtype at 1 element and 4 KiB; the larger sizes for the sums only.
      if (numel > 1024 && !(kind.op == ReduceOp::kSum && (kind.dtype == at::kFloat || kind.dtype == at::kLong))) continue;
      const at::Tensor want = locally_reduced(world, numel, kind.dtype, kind.op);
      at::Tensor ring;
      for (AllreduceAlgorithm algorithm : kSchedules) {
        pg.set_allreduce_algorithm(algorithm);
        at::Tensor t = schedule_input(pg.rank(), numel, kind.dtype, kind.op);
        pg.allreduce(t, {kind.op})->wait();
        const std::string what = std::string(to_string(algorithm)) + " (ran " +
                                 to_string(pg.last_allreduce_algorithm()) + "), world " +
                                 std::to_string(world) + ", " + std::to_string(numel) + " x " +
                                 c10::toString(kind.dtype) + ", " + to_string(kind.op);
        if (algorithm == AllreduceAlgorithm::kRing) ring = t;
        if (kind.dtype == at::kFloat && kind.op == ReduceOp::kSum) {
          expect_close_sums(t, ring, world, what + ": against the ring");
          expect_close_sums(t, want, world, what + ": against the local sum");
        } else if (!t.equal(ring) || !t.equal(want)) {
          failures.push_back(what);
        }
      }
    }
  }
}

// Every schedule (and auto) on 2, 3, 4, 5 and 8 ranks: non-powers of two fold their extra ranks
// in; the sizes leave some blocks empty (1 element) or uneven (1 MiB + 3 floats).
TEST(AllreduceSchedules, EqualTheRingAndTheLocalReduction) {
  torch::set_num_threads(1);
  for (int world : {2, 3, 4, 5, 8}) {
    auto store = make_hash_store(Milliseconds(60'000));
    std::mutex mutex;
    std::vector<std::string> failures;
    shoal::testing::run_threads(world, [&](int rank) {
      ProcessGroupGloo pg(store, rank, world, Milliseconds(60'000));
      std::vector<std::string> mine;
      check_schedules_on_rank(pg, world, mine);
      std::lock_guard<std::mutex> lock(mutex);
      failures.insert(failures.end(), mine.begin(), mine.end());
    });
    EXPECT_TRUE(failures.empty()) << failures.size() << " wrong results, first: " << failures[0];
  }
}

// auto runs, for each size, the schedule the cost model predicts fastest for this group; on one
// host (the loopback) the model sees one node of every rank.
TEST(AllreduceSchedules, AutoRunsWhatTheModelChooses) {
  torch::set_num_threads(1);
  for (int world : {3, 4}) {
    auto store = make_hash_store(Milliseconds(60'000));
    shoal::testing::run_threads(world, [&](int rank) {
      GlooOptions options;
      options.allreduce_algorithm = AllreduceAlgorithm::kAuto;
      ProcessGroupGloo pg(store, rank, world, Milliseconds(60'000), options);
      EXPECT_EQ(pg.allreduce_topology().ranks_per_node, world);
      EXPECT_EQ(pg.allreduce_topology().cores_per_node,
                static_cast<int>(std::thread::hardware_concurrency()));
      for (int64_t numel : {int64_t{1}, int64_t{1024}, int64_t{65536}, int64_t{1} << 22}) {
        const auto want = algorithms::choose_allreduce_algorithm(
            numel * 4, pg.allreduce_topology(), algorithms::CostModel::defaults());
        EXPECT_EQ(pg.allreduce_algorithm_for(numel * 4), want);
        at::Tensor t = at::ones({numel});
        pg.allreduce(t)->wait();
        EXPECT_EQ(pg.last_allreduce_algorithm(), want) << numel;
        EXPECT_TRUE(t.eq(world).all().item<bool>());
      }
    });
  }
}

// The model's predictions are the schedules' step counts: ring 2(n-1) messages of B/n,
// recursive doubling log2(n) of B (plus the fold in and out for 5 ranks), Rabenseifner
// 2 log2(n) of halving sizes, each step longer where its senders outnumber a node's cores. Small messages go to recursive doubling; large ones to
// Rabenseifner on a power of two (the ring's bytes in fewer steps), to the ring otherwise (the
// fold moves the whole tensor twice), and to Rabenseifner over 512 nodes.
TEST(AllreduceSchedules, CostModelCountsTheSteps) {
  algorithms::CostModel m;
  m.intra_node = {1e-5, 1e-9};
  m.inter_node = {1e-4, 2e-9};
  m.gamma_s_per_byte = 5e-10;
  const int64_t bytes = int64_t{1} << 20;
  const double b = static_cast<double>(bytes);
  const algorithms::Topology one_node{4, 4};
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kRing, bytes, one_node, m),
                   6 * (1e-5 + b / 4 * 1e-9) + 3 * b / 4 * 5e-10);
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kRecursiveDoubling, bytes, one_node, m),
                   2 * (1e-5 + b * 1e-9 + b * 5e-10));
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kRabenseifner, bytes, one_node, m),
                   2 * (2 * 1e-5 + b / 2 * 1e-9 + b / 4 * 1e-9) + (b / 2 + b / 4) * 5e-10);
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kTree, bytes, one_node, m),
                   2 * (2 * (1e-5 + b * 1e-9) + b * 5e-10));
  const algorithms::Topology five{5, 5};
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kRecursiveDoubling, bytes, five, m),
                   predicted_seconds(AllreduceAlgorithm::kRecursiveDoubling, bytes, one_node, m) +
                       2 * (1e-5 + b * 1e-9) + b * 5e-10);
  // Two nodes of two: the ring's every step crosses; the recursive schedules' first (mask 1)
  // steps stay inside a node.
  const algorithms::Topology two_by_two{4, 2};
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kRing, bytes, two_by_two, m),
                   6 * (1e-4 + b / 4 * 2e-9) + 3 * b / 4 * 5e-10);
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kRecursiveDoubling, bytes, two_by_two, m),
                   (1e-5 + b * 1e-9) + (1e-4 + b * 2e-9) + 2 * b * 5e-10);
  EXPECT_EQ(choose_allreduce_algorithm(4, {8, 8}, m), AllreduceAlgorithm::kRecursiveDoubling);
  EXPECT_EQ(choose_allreduce_algorithm(64 << 20, {6, 6}, m), AllreduceAlgorithm::kRing);
  EXPECT_EQ(choose_allreduce_algorithm(64 << 20, {8, 8}, m), AllreduceAlgorithm::kRabenseifner);
  EXPECT_EQ(choose_allreduce_algorithm(64 << 20, {512, 1}, m), AllreduceAlgorithm::kRabenseifner);
  // Eight ranks on two cores: every rank sending at once queues four deep for the cores, the
  // tree's later steps do not; small messages go to the tree.
  const algorithms::Topology crowded{8, 8, 2};
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kRecursiveDoubling, bytes, crowded, m),
                   3 * (4 * (1e-5 + b * 1e-9) + b * 5e-10));
  EXPECT_DOUBLE_EQ(predicted_seconds(AllreduceAlgorithm::kTree, bytes, crowded, m),
                   2 * (2 + 1 + 1) * (1e-5 + b * 1e-9) + 3 * b * 5e-10);
  EXPECT_EQ(choose_allreduce_algorithm(4096, crowded, m), AllreduceAlgorithm::kTree);
}

// SHOAL_ALLREDUCE_ALGO picks the algorithm of a group built without one; a wrong value is
// refused naming the variable.
TEST(AllreduceSchedules, EnvironmentVariableChooses) {
  auto store = make_hash_store(Milliseconds(30'000));
  ::setenv("SHOAL_ALLREDUCE_ALGO", "tree", 1);
  shoal::testing::run_threads(2, [&](int rank) {
    auto pg = new_process_group("gloo", store, rank, 2, Milliseconds(30'000));
    at::Tensor t = at::full({3}, rank + 1.0f);
    pg->allreduce(t)->wait();
    EXPECT_EQ(dynamic_cast<ProcessGroupGloo&>(*pg).last_allreduce_algorithm(), AllreduceAlgorithm::kTree);
    EXPECT_TRUE(t.eq(3).all().item<bool>());
  });
  ::setenv("SHOAL_ALLREDUCE_ALGO", "fastest", 1);
  try {
    ProcessGroupGloo pg(make_hash_store(), 0, 1, Milliseconds(10'000));
    ADD_FAILURE() << "expected an error";
  } catch (const shoal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("SHOAL_ALLREDUCE_ALGO"), std::string::npos) << e.what();
  }
  ::unsetenv("SHOAL_ALLREDUCE_ALGO");
}

TEST(ProcessGroupArguments, NonContiguousIsRefusedClearly) {
  auto store = make_hash_store();
  auto pg = new_process_group("gloo", store, 0, 1);
  auto t = torch::ones({4, 4}).t();
  try {
    pg->allreduce(t);
    FAIL() << "expected an error";
  } catch (const shoal::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not contiguous"), std::string::npos) << e.what();
  }
}

// Each operation's description, built from its label only when asked for, reads as it always
// has: name, sequence number, size, dtype and the operation's own details.
TEST(OpLabels, WorkDescribesItsOperation) {
  auto store = make_hash_store(Milliseconds(30'000));
  for (const std::string backend : {"gloo", "shm", "hierarchical"}) {
    SCOPED_TRACE(backend);
    shoal::testing::run_threads(2, [&](int rank) {
      auto pg = new_process_group(backend, make_prefix_store(backend, store), rank, 2,
                                  Milliseconds(30'000));
      const uint64_t first = pg->sequence_number() + 1;
      auto t = torch::ones({1000});
      auto reduced = pg->allreduce(t);
      reduced->wait();
      EXPECT_EQ(reduced->description(),
                "allreduce #" + std::to_string(first) + " (4.0 kB float32, sum)");
      EXPECT_EQ(reduced->sequence_number(), first);
      auto small = torch::zeros({3}, torch::kLong);
      BroadcastOptions from_one;
      from_one.root = 1;
      auto broadcast = pg->broadcast(small, from_one);
      broadcast->wait();
      EXPECT_EQ(broadcast->description(),
                "broadcast #" + std::to_string(first + 1) + " (24 B int64, root 1)");
      auto barrier = pg->barrier();
      barrier->wait();
      EXPECT_EQ(barrier->description(), "barrier #" + std::to_string(first + 2));
      auto half = torch::zeros({500}, torch::kHalf);
      auto p2p = rank == 0 ? pg->send(half, 1) : pg->recv(half, 0);
      p2p->wait();
      const std::string text = p2p->description();
      const std::string kind = rank == 0 ? "send #" : "recv #";
      const std::string details = rank == 0 ? "(1.0 kB float16 to rank 1, tag 0)"
                                            : "(1.0 kB float16 from rank 0, tag 0)";
      if (backend == "hierarchical") {
        // Point-to-point goes to its flat group, whose own Work (and number) it returns.
        EXPECT_EQ(text.rfind(kind, 0), 0u) << text;
        ASSERT_GE(text.size(), details.size()) << text;
        EXPECT_EQ(text.substr(text.size() - details.size()), details) << text;
      } else {
        EXPECT_EQ(text, kind + std::to_string(first + 3) + " " + details);
      }
    });
  }
}

TEST(OpLabels, PrefixNamesTheRank) {
  OpLabel label;
  label.name = "reduce";
  label.sequence = 7;
  label.rank = 2;
  label.size = 4;
  label.numel = 2'000'000;
  label.dtype = at::kBFloat16;
  label.reduce_op = static_cast<int>(ReduceOp::kMax);
  label.root = 3;
  EXPECT_EQ(label.prefix(), "[rank 2/4] reduce #7 (4.0 MB bfloat16, max, root 3)");
  label.detail = "group 2, 3 ranks";
  EXPECT_EQ(label.description(), "reduce #7 (group 2, 3 ranks)");
}

// A CUDA tensor's operation says so (a multi-device group's ranks that disagree on the device are
// told which device each used); a CPU tensor's names no device.
TEST(OpLabels, NameTheDeviceWhenItIsNotTheCpu) {
  OpLabel label;
  label.name = "allreduce";
  label.sequence = 3;
  label.numel = 1000;
  label.dtype = at::kFloat;
  label.reduce_op = static_cast<int>(ReduceOp::kSum);
  EXPECT_EQ(label.description(), "allreduce #3 (4.0 kB float32, sum)");
  label.device = c10::DeviceType::CUDA;
  EXPECT_EQ(label.description(), "allreduce #3 (4.0 kB float32 on cuda, sum)");
}

}  // namespace test_collectives
}  // namespace shoal::comm
