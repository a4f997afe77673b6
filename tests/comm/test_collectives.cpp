// Every collective of every backend, on 1..4 ranks, element counts 0, 1, odd and large, checked
// against values computed independently (collective_checks.h): ranks as threads of one process
// over an in-memory store, and ranks as forked processes meeting through a file store. The same
// checks run under mpirun in test_collectives_mpi.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cctype>
#include <cstdlib>

#include "collective_checks.h"
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
// told which device each used); a CPU tensor's reads as before.
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
