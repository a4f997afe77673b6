// FullyShardedDataParallel's stage 1 (sharded optimizer state) against PyTorch's own
// ZeroRedundancyOptimizer under DistributedDataParallel (zero_oracle.py: Debian's python3-torch
// 1.13, gloo, 2 processes): the same model (uneven parameter sizes, BatchNorm, an unused
// parameter), closed-form weights and data give the same parameters and buffers after 20 steps of
// SGD with momentum and of Adam. Exits 77 (skipped) when the oracle's Python has no torch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "fsdp_test_model.h"
#include "shoal/comm/init.h"
#include "shoal/parallel/fully_sharded_data_parallel.h"
#include "test_models.h"
#include "testing/dependencies.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace shoal::parallel {
namespace test_fsdp_vs_pytorch {

using namespace shoal::testing::fsdp_model;  // NOLINT: the shared model of the FSDP tests

constexpr int kWorld = 2;
constexpr int kSteps = 20;
constexpr int64_t kBatchPerRank = 4;

std::string oracle_python() {
  const char* given = std::getenv("SHOAL_ORACLE_PYTHON");
  return given && *given ? given : "/usr/bin/python3";
}

at::Tensor read_doubles(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return {};
  const auto bytes = static_cast<int64_t>(in.tellg());
  if (bytes <= 0 || bytes % 8 != 0 || bytes > (int64_t{1} << 26)) return {};
  at::Tensor out = torch::empty({bytes / 8}, torch::kDouble);
  in.seekg(0);
  in.read(static_cast<char*>(out.data_ptr()), bytes);
  return in ? out : at::Tensor();
}

void compare_stage_one(const std::string& optimizer_kind) {
  const std::string out = shoal::testing::temp_path("zero_oracle") + ".f64";
  const char* source = std::getenv("SHOAL_SOURCE_DIR");
  const std::string script = std::string(source ? source : "..") + "/tests/parallel/zero_oracle.py";
  const std::string command = "timeout 240 " + oracle_python() + " " + script + " " +
                              optimizer_kind + " " + std::to_string(kSteps) + " " +
                              std::to_string(kBatchPerRank) + " " + out;
  auto oracle = shoal::testing::run_command(command);
  if (oracle.exit_code == shoal::testing::kNoTorchExitCode) {
    SHOAL_SKIP_TEST(shoal::testing::Dependency::kPythonTorch, oracle_python() + " has no torch");
  }
  ASSERT_TRUE(shoal::testing::oracle_succeeded(oracle)) << command;
  const at::Tensor expected = read_doubles(out);
  std::remove(out.c_str());
  ASSERT_TRUE(expected.defined()) << "the oracle wrote no results to " << out;

  std::vector<at::Tensor> mine;
  torch::set_num_threads(1);
  auto store = comm::make_hash_store(std::chrono::milliseconds(60'000));
  shoal::testing::run_threads(kWorld, [&](int rank) {
    auto group = comm::new_process_group("gloo", store, rank, kWorld);
    torch::manual_seed(10 + rank);
    auto model = make_model();
    if (rank == 0) set_initial_weights(*model);
    FullyShardedDataParallelOptions options;
    options.sharding_strategy = ShardingStrategy::kShardOptimState;
    options.auto_wrap_min_num_params = 50;
    FullyShardedDataParallel fsdp(model, group, options);
    auto optimizer = make_optimizer(optimizer_kind, fsdp.parameters());
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, kBatchPerRank * kWorld);
      optimizer->zero_grad();
      auto output = fsdp.forward(x.narrow(0, rank * kBatchPerRank, kBatchPerRank));
      torch::nll_loss(output, y.narrow(0, rank * kBatchPerRank, kBatchPerRank)).backward();
      optimizer->step();
    }
    fsdp.gather_full_parameters();
    if (rank == 0) {
      for (const auto& t : state_of(*model)) mine.push_back(t.to(torch::kDouble).flatten());
    }
  });
  const at::Tensor actual = torch::cat(mine);
  ASSERT_EQ(actual.numel(), expected.numel()) << "the oracle's model differs from the test's";
  const double relative =
      (actual - expected).abs().max().item<double>() / expected.abs().max().item<double>();
  std::printf("stage 1 %s: max relative difference from PyTorch's ZeroRedundancyOptimizer after "
              "%d steps: %.3g\n", optimizer_kind.c_str(), kSteps, relative);
  EXPECT_LE(relative, 1e-5);
}

TEST(FsdpVsPyTorch, StageOneSgdMomentumMatchesZeroRedundancyOptimizer) { compare_stage_one("sgd"); }
TEST(FsdpVsPyTorch, StageOneAdamMatchesZeroRedundancyOptimizer) { compare_stage_one("adam"); }

}  // namespace test_fsdp_vs_pytorch
}  // namespace shoal::parallel
