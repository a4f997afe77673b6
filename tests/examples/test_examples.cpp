// examples/*.cpp run as a user would run them, on tiny data: they exit 0 and print what their
// comments promise, and the models in them learn.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "testing/idx_files.h"
#include "testing/multi_rank.h"
#include "testing/python.h"

namespace test_examples {

namespace fs = std::filesystem;

// The numbers after `pattern`'s first group, one per match, in order.
std::vector<double> numbers_after(const std::string& text, const std::string& pattern) {
  std::vector<double> values;
  const std::regex re(pattern);
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it) {
    values.push_back(std::stod((*it)[1].str()));
  }
  return values;
}

// Environment without a launcher's variables: a lone process is rank 0 of 1.
const char* kClean = "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT "
                     "-u OMPI_COMM_WORLD_RANK -u PMI_RANK OMP_NUM_THREADS=1 ";

// The README's example on a tiny Fashion-MNIST-shaped folder: both of its loops run and report an
// accuracy (too few samples for the CNN to learn in one epoch: that is test_train_api's job), and
// the trainer writes its metrics file.
TEST(Examples, TrainFashionMnistRunsOnAGivenFolder) {
  const std::string data = shoal::testing::make_small_dataset_dir(128, 32);
  const std::string cwd = shoal::testing::make_temp_dir("shoal-example");  // metrics.jsonl goes here
  const auto run = shoal::testing::run_command("cd " + cwd + " && " + kClean +
                                               SHOAL_EXAMPLE_TRAIN + " " + data);
  ASSERT_EQ(run.exit_code, 0) << run.describe() << run.out;
  const auto trainer = numbers_after(run.out, "trainer: test accuracy ([0-9.]+)");
  const auto by_hand = numbers_after(run.out, "hand-written loop: test accuracy ([0-9.]+)");
  ASSERT_EQ(trainer.size(), 1u) << run.out;
  ASSERT_EQ(by_hand.size(), 1u) << run.out;
  for (double accuracy : {trainer[0], by_hand[0]}) {
    EXPECT_GE(accuracy, 0.0) << run.out;
    EXPECT_LE(accuracy, 1.0) << run.out;
  }
  EXPECT_NE(run.out.find("epoch 1/1: train loss"), std::string::npos) << run.out;
  EXPECT_TRUE(fs::exists(cwd + "/metrics.jsonl"));
  fs::remove_all(cwd);
  fs::remove_all(data);
}

// The DDP example as two ranks under `shoal run`, as its comment shows: three epochs whose loss
// falls (synthetic data that can be learnt), every line saying 2 ranks.
TEST(Examples, DdpFashionMnistUnderTheLauncher) {
  const auto two = shoal::testing::run_command(std::string(kClean) + SHOAL_CLI +
                                               " run --nproc-per-node 2 " + SHOAL_EXAMPLE_DDP);
  ASSERT_EQ(two.exit_code, 0) << two.describe() << two.out;
  const auto losses = numbers_after(two.out, "epoch [0-9]+: loss ([0-9.]+) \\(2 ranks x 32 steps\\)");
  ASSERT_EQ(losses.size(), 3u) << two.out << two.err;
  EXPECT_LT(losses[2], losses[0]) << two.out;
}

}  // namespace test_examples
