// `shoal train --strategy fsdp --shard 1|2|3` as a user runs it: two ranks train the MLP on the
// same Fashion-MNIST samples as `--strategy ddp` and end with DDP's parameters; bad arguments are
// refused in one line.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>

#include "shoal/checkpoint/serialization.h"
#include "testing/multi_rank.h"
#include "testing/shoal_cli.h"

namespace test_fsdp_cli {

namespace fs = std::filesystem;

std::string shoal_binary() { return shoal::testing::shoal_cli_with_dataset(); }

// Trains the MLP on 256 samples (8 steps of 2 x 16) with `strategy_args`; returns rank 0's and
// rank 1's final parameters.
std::vector<shoal::checkpoint::StateDict> train(const std::string& strategy_args) {
  const std::string prefix = shoal::testing::temp_path("shoal-fsdp-cli");
  const std::string command = shoal_binary() + " train " + strategy_args +
                              " --nproc-per-node 2 --model mlp --train-samples 256"
                              " --test-samples 32 --epochs 1 --batch-size 16 --no-progress"
                              " --dump-parameters " + prefix + " >/dev/null 2>" + prefix + ".err";
  const int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << command << "\n" << shoal::testing::read_file(prefix + ".err");
  std::vector<shoal::checkpoint::StateDict> states;
  for (const auto& rank : {".rank0.pt", ".rank1.pt"}) {
    if (fs::exists(prefix + rank)) states.push_back(shoal::checkpoint::load_state_dict_file(prefix + rank));
    fs::remove(prefix + rank);
  }
  fs::remove(prefix + ".err");
  return states;
}

double max_relative_difference(const shoal::checkpoint::StateDict& a,
                               const shoal::checkpoint::StateDict& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& item : a) {
    const at::Tensor& other = b[item.key()];
    worst = std::max(worst, (item.value() - other).abs().max().item<double>() /
                                std::max(other.abs().max().item<double>(), 1e-12));
  }
  return worst;
}

TEST(FsdpCli, EveryStageTrainsToDdpsParameters) {
  const auto ddp = train("--strategy ddp");
  ASSERT_EQ(ddp.size(), 2u);
  for (int shard : {1, 2, 3}) {
    const auto fsdp = train("--strategy fsdp --shard " + std::to_string(shard));
    ASSERT_EQ(fsdp.size(), 2u) << "shard " << shard;
    for (int rank = 0; rank < 2; ++rank) {
      const double difference = max_relative_difference(fsdp[rank], ddp[rank]);
      std::printf("--shard %d rank %d: max relative difference from --strategy ddp %.3g\n", shard,
                  rank, difference);
      EXPECT_LE(difference, 1e-6) << "shard " << shard << " rank " << rank;
    }
  }
}

TEST(FsdpCli, RefusesCheckpointsAndBadStages) {
  const std::string err = shoal::testing::temp_path("shoal-fsdp-cli") + ".err";
  auto run = [&](const std::string& args) {
    const std::string command = shoal_binary() + " train " + args + " >/dev/null 2>" + err;
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_NE(run("--strategy fsdp --shard 4"), 0);
  EXPECT_NE(shoal::testing::read_file(err).find("--shard"), std::string::npos)
      << shoal::testing::read_file(err);
  EXPECT_NE(run("--strategy fsdp --checkpoint-dir " + err + ".ckpt"), 0);
  EXPECT_NE(shoal::testing::read_file(err).find("--strategy fsdp does not save or resume"),
            std::string::npos)
      << shoal::testing::read_file(err);
  fs::remove(err);
  fs::remove_all(err + ".ckpt");
}

}  // namespace test_fsdp_cli
