// `shoal train --strategy fsdp --shard 1|2|3` as a user runs it: two ranks train the MLP on the
// same Fashion-MNIST samples as `--strategy ddp` and end with DDP's parameters; checkpoints of
// fsdp and ddp resume in each other (the optimizer state gathered from and scattered to the
// shards) to the uninterrupted run's parameters, and at another world size as ddp does; a bad
// stage is refused in one line.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>

#include "shoal/checkpoint/serialization.h"
#include "testing/multi_rank.h"
#include "testing/python.h"
#include "testing/shoal_cli.h"

namespace test_fsdp_cli {

namespace fs = std::filesystem;

std::string shoal_binary() { return shoal::testing::shoal_cli_with_dataset(); }

// Trains the MLP on 256 samples (8 steps of 2 x 16 an epoch) with `strategy_args` on `ranks`
// processes; returns each rank's final parameters.
std::vector<shoal::checkpoint::StateDict> train(const std::string& strategy_args, int ranks = 2,
                                                const std::string& more = "--epochs 1") {
  const std::string prefix = shoal::testing::temp_path("shoal-fsdp-cli");
  const std::string command = shoal_binary() + " train " + strategy_args + " --nproc-per-node " +
                              std::to_string(ranks) + " --model mlp --train-samples 256"
                              " --test-samples 32 --batch-size 16 --no-progress " + more +
                              " --dump-parameters " + prefix + " >/dev/null 2>" + prefix + ".err";
  const int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << command << "\n" << shoal::testing::read_file(prefix + ".err");
  std::vector<shoal::checkpoint::StateDict> states;
  for (int rank = 0; rank < ranks; ++rank) {
    const std::string path = prefix + ".rank" + std::to_string(rank) + ".pt";
    if (fs::exists(path)) states.push_back(shoal::checkpoint::load_state_dict_file(path));
    fs::remove(path);
  }
  fs::remove(prefix + ".err");
  return states;
}

using shoal::testing::max_relative_difference;

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

// Checkpoints hold the whole optimizer state (fsdp gathers it from the shards; a resume gives
// each rank its shard of it): one format for both strategies, at any world size.
TEST(FsdpCli, CheckpointsResumeAcrossStrategiesAndWorldSizes) {
  const std::string dir = shoal::testing::temp_path("shoal-fsdp-ckpt");
  const auto uninterrupted = train("--strategy ddp", 2, "--epochs 2");
  ASSERT_EQ(uninterrupted.size(), 2u);
  auto expect_equal = [&](const std::vector<shoal::checkpoint::StateDict>& got,
                          const std::vector<shoal::checkpoint::StateDict>& want,
                          const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t r = 0; r < got.size(); ++r) {
      const double difference = max_relative_difference(got[r], want[r]);
      std::printf("%s rank %zu: max relative difference %.3g\n", what.c_str(), r, difference);
      EXPECT_LE(difference, 1e-6) << what << " rank " << r;
    }
  };
  // Saved by fsdp (stage 3) after epoch 1, resumed by ddp; saved by ddp, resumed by fsdp (stage 2).
  train("--strategy fsdp --shard 3", 2, "--epochs 1 --checkpoint-dir " + dir + "/a");
  // PyTorch reads it: the unsharded MLP loads the model strictly, and the optimizer holds a
  // whole momentum buffer for every parameter.
  const std::string check =
      "/usr/bin/python3 -c \"import sys, torch, torch.nn as nn; "
      "d = torch.load(sys.argv[1]); "
      "m = nn.Module(); m.fc1 = nn.Linear(784, 1024); m.fc2 = nn.Linear(1024, 1024); "
      "m.fc3 = nn.Linear(1024, 10); m.load_state_dict(d['model']); "
      "st = d['optimizer']['state']; ps = list(m.parameters()); "
      "assert len(st) == len(ps), len(st); "
      "assert all(st[i]['momentum_buffer'].shape == p.shape for i, p in enumerate(ps)); "
      "print('ORACLE OK torch.load read the fsdp checkpoint')\" " +
      dir + "/a/checkpoint_000000.pt";
  EXPECT_TRUE(shoal::testing::oracle_succeeded(shoal::testing::run_command(check))) << check;
  fs::copy(dir + "/a", dir + "/a3", fs::copy_options::recursive);
  fs::copy(dir + "/a", dir + "/a3ddp", fs::copy_options::recursive);
  expect_equal(train("--strategy ddp", 2, "--epochs 2 --resume --checkpoint-dir " + dir + "/a"),
               uninterrupted, "fsdp checkpoint resumed by ddp");
  train("--strategy ddp", 2, "--epochs 1 --checkpoint-dir " + dir + "/b");
  expect_equal(train("--strategy fsdp --shard 2", 2,
                     "--epochs 2 --resume --checkpoint-dir " + dir + "/b"),
               uninterrupted, "ddp checkpoint resumed by fsdp --shard 2");
  // At 3 ranks, the fsdp checkpoint continues exactly as ddp continues it.
  expect_equal(train("--strategy fsdp --shard 3", 3,
                     "--epochs 2 --resume --checkpoint-dir " + dir + "/a3"),
               train("--strategy ddp", 3, "--epochs 2 --resume --checkpoint-dir " + dir + "/a3ddp"),
               "fsdp checkpoint of 2 ranks resumed at 3 by fsdp and by ddp");
  fs::remove_all(dir);
}

TEST(FsdpCli, RefusesABadStage) {
  const std::string err = shoal::testing::temp_path("shoal-fsdp-cli") + ".err";
  const std::string command = shoal_binary() + " train --strategy fsdp --shard 4 >/dev/null 2>" + err;
  const int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0);
  EXPECT_NE(shoal::testing::read_file(err).find("--shard"), std::string::npos)
      << shoal::testing::read_file(err);
  fs::remove(err);
}

}  // namespace test_fsdp_cli
