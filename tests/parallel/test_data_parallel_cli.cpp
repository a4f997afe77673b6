// `shoal train --strategy dp --replicas K` and `--strategy ddp --model-parallel 2` as a user runs
// them: on the same Fashion-MNIST samples they end with the parameters of single-process training
// (dp) and of plain DDP (model parallel x DDP), to float tolerance.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>

#include "shoal/checkpoint/serialization.h"
#include "testing/idx_files.h"
#include "testing/multi_rank.h"

namespace {

namespace fs = std::filesystem;

std::string shoal_binary() {
  const char* dir = std::getenv("SHOAL_BINARY_DIR");
  if (dir == nullptr) shoal::testing::skip_program("SHOAL_BINARY_DIR is not set (run through ctest)");
  const std::string path = std::string(dir) + "/apps/shoal/shoal";
  if (!fs::exists(path)) shoal::testing::skip_program(path + " is not built");
  if (!shoal::testing::have_real_fashion_mnist()) {
    shoal::testing::skip_program("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)");
  }
  return path;
}

// Trains the MLP on 256 samples with `strategy_args`; returns rank 0's final parameters.
shoal::checkpoint::StateDict train(const std::string& strategy_args) {
  const std::string prefix = shoal::testing::temp_path("shoal-dp-cli");
  const std::string command = shoal_binary() + " train " + strategy_args +
                              " --model mlp --train-samples 256 --test-samples 32 --epochs 1"
                              " --batch-size 32 --no-progress --dump-parameters " + prefix +
                              " >/dev/null 2>" + prefix + ".err";
  const int status = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command;
  auto state = shoal::checkpoint::load_state_dict_file(prefix + ".rank0.pt");
  for (const auto& suffix : {".rank0.pt", ".rank1.pt", ".err"}) fs::remove(prefix + suffix);
  return state;
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

TEST(DataParallelCli, DpReplicasTrainLikeOneProcess) {
  const auto single = train("--strategy single --threads 1");
  EXPECT_LT(max_relative_difference(train("--strategy dp --replicas 2"), single), 1e-5);
  // 3 replicas split each batch of 32 unevenly (11, 11, 10): still one process's result.
  EXPECT_LT(max_relative_difference(train("--strategy dp --replicas 3"), single), 1e-5);
}

TEST(DataParallelCli, ModelParallelDdpTrainsLikeDdp) {
  const auto ddp = train("--strategy ddp --nproc-per-node 2");
  EXPECT_LT(max_relative_difference(train("--strategy ddp --nproc-per-node 2 --model-parallel 2"), ddp),
            1e-5);
}

}  // namespace
